"""Fault: the driver joins a Ray cluster (RAY_ADDRESS) that was started without token authentication.

Anyone who can reach such a cluster's ports can run code on it. vlmrl must say
so at start, and a flag must silence it for a cluster firewalled to the user.
(A real ``ray start --head`` cluster is not started here; the rule is the
driver's environment, since a driver without the token cannot join a cluster
that requires one.)
"""

from __future__ import annotations

from vlmrl.driver.cluster_auth import unauthenticated_cluster_warning
from vlmrl.validate import load_config


def test_joining_a_cluster_without_token_auth_warns_with_the_fix():
    warning = unauthenticated_cluster_warning({"RAY_ADDRESS": "10.0.0.1:6379"}, enabled=True)
    assert "RAY_ADDRESS=10.0.0.1:6379 is a Ray cluster without token authentication" in warning
    assert "RAY_AUTH_MODE=token" in warning and "trainer.warn_unauthenticated_ray=false" in warning


def test_no_warning_with_token_auth_a_local_cluster_or_the_flag_off():
    assert unauthenticated_cluster_warning({"RAY_ADDRESS": "h:6379", "RAY_AUTH_MODE": "token"}, enabled=True) is None
    assert unauthenticated_cluster_warning({}, enabled=True) is None  # a local cluster: Ray turns auth on itself
    assert unauthenticated_cluster_warning({"RAY_ADDRESS": "h:6379"}, enabled=False) is None


def test_the_flag_is_a_config_key():
    config = load_config(["config=examples/quickstart.yaml", "trainer.warn_unauthenticated_ray=false"])
    assert config.trainer.warn_unauthenticated_ray is False
