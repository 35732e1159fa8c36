"""One attempt of a training run: what it starts, the process (group) it owns, how Pipes
carries its messages, and the record of how it ended."""
