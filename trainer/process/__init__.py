"""The process side: stop signals, liveness, the orchestrator's contract and reports, the standby."""
