"""Locally built test assets: a tiny random-init VLM and synthetic image-QA data.

Nothing here downloads; see ``assets.ensure_tiny_assets`` for the cached pair
that tests and the quickstart share.
"""
