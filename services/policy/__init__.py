"""Policy: decides where admitted tasks run, reserving capacity in the ledger before it speaks."""
