"""The user API: `CheckpointSession`, its parts, `ResumableLoader`, and the task interface."""
