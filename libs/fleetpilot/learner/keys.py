"""Where the learner keeps what it learns: its models in the ``models`` bucket, the outcomes
it learns from in a file of its state directory."""

PROMOTED_KEY = "outcome"
"""The promoted outcome model: the only key the policies read."""
CANDIDATE_KEY = "outcome-candidate"
"""The latest model that was not promoted, for an operator to look at."""
STORE_FILE = "learner.db"
"""The learner service's SQLite file of decisions and outcomes, in its state directory."""
