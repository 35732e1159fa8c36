"""The commit protocol: manifests, the pointer, verification, retention, datasets by reference."""
