"""How the daemon stops, in one process or as an engine core with API processes: SIGTERM (or
SIGINT) drains, a second signal ends it at once, and a backstop ends a shutdown that stalls."""

# After the drain deadline: how long the last events may take to leave, and then how long the
# rest of the shutdown (connections, ranks) may take before the backstop ends the process.
SHUTDOWN_GRACE_S = 2.0
BACKSTOP_S = 15.0
# A repeat of the first signal this soon is the same signal delivered twice (`timeout` forwarding
# it, or a kill to the process and to its group), not an operator asking to stop at once.
SAME_SIGNAL_S = 1.0
