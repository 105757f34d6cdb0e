"""SLA negotiator: authenticates submissions and agrees what can be promised before admitting."""
