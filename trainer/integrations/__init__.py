"""The training frameworks whose loops the session makes crash-safe (docs/frameworks.md).

`hf` (Hugging Face `Trainer`) and `lightning` (Lightning `Trainer`) each import their
framework on first use, so `trainer` works without them; both keep the framework's own
checkpoint files and commit them through the commit protocol (`files`). torchdata's
StatefulDataLoader needs no module here: it is a part like any other
(`trainer.api.stateful_loader`).
"""
