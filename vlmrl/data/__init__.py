"""The data pipeline: image-aware prompt datasets and their resumable loader."""
