"""A warning when the driver joins a Ray cluster that runs code for anyone who can reach it.

Ray 2.60 turns token authentication on for the local cluster ``ray.init()``
starts, but ``ray start --head`` runs without it unless ``RAY_AUTH_MODE=token``
is set, and then anyone who can reach the cluster's ports can run code there.
A driver without the token cannot join a cluster that requires one, so a driver
that joined ``RAY_ADDRESS`` without ``RAY_AUTH_MODE=token`` is on a cluster
without authentication.
"""

from __future__ import annotations

from collections.abc import Mapping


def unauthenticated_cluster_warning(env: Mapping[str, str], enabled: bool) -> str | None:
    """The warning to print once the driver has joined the cluster, or None."""
    address = env.get("RAY_ADDRESS")
    if not enabled or not address or env.get("RAY_AUTH_MODE", "").lower() == "token":
        return None
    return (
        f"vlmrl: warning: RAY_ADDRESS={address} is a Ray cluster without token authentication: anyone who can "
        "reach its ports can run code on its nodes. Start it with RAY_AUTH_MODE=token (docs/guides/gpu.md, "
        "Multi-node), or, "
        "if the cluster is firewalled to you alone, silence this with trainer.warn_unauthenticated_ray=false"
    )
