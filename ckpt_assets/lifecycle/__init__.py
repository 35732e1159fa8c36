"""A training run's life across attempts: its states and events, the failure policy, the
one decision per ended attempt, liveness, stopping, and a re-run's link to its chain."""
