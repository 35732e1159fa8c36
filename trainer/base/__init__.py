"""The vocabulary every layer of the trainer stands on: errors, outcomes, strict JSON, the interval's arithmetic."""
