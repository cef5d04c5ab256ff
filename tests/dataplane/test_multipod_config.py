"""How an instance reads LeaderWorkerSet's env: which ranks a pod runs, and what it refuses."""

from __future__ import annotations

import pytest

from pdd_sidecar.env import ConfigError, InstanceSettings
from pdd_sidecar.kv.grants import GrantError, sign, verify

pytestmark = pytest.mark.dataplane

BASE = {"PDD_ROLE": "prefill", "PDD_TP_SIZE": "4", "PDD_DCP_SIZE": "4", "PDD_BLOCK_SIZE": "16",
        "PDD_ROUTING_FILE": "/r.json", "PDD_GRANT_KEY_FILE": "/k"}


def _settings(**env: str) -> InstanceSettings:
    return InstanceSettings.from_env({**BASE, **env})


def test_without_lws_env_an_instance_is_one_pod_with_every_rank() -> None:
    s = _settings()
    assert (s.group_size, s.worker_index, s.spans_pods, s.is_leader) == (1, 0, False, True)
    assert list(s.local_ranks) == [0, 1, 2, 3] and s.rendezvous_host == "127.0.0.1"
    assert list(_settings(LWS_GROUP_SIZE="1", PDD_RANKS_PER_POD="4").local_ranks) == [0, 1, 2, 3]


@pytest.mark.parametrize(("size", "index", "ranks"), [
    ("2", "0", [0, 1]), ("2", "1", [2, 3]), ("4", "3", [3]), ("4", "0", [0])])
def test_pod_k_of_a_group_runs_ranks_k_g_to_k_g_plus_g_minus_1(
        size: str, index: str, ranks: list[int]) -> None:
    s = _settings(LWS_GROUP_SIZE=size, LWS_WORKER_INDEX=index, LWS_LEADER_ADDRESS="v3-p-0.v3-p")
    assert list(s.local_ranks) == ranks and s.spans_pods
    assert s.is_leader == (index == "0") and s.rendezvous_host == "v3-p-0.v3-p"
    assert _settings(LWS_GROUP_SIZE=size, LWS_WORKER_INDEX=index,
                     LWS_LEADER_ADDRESS="fd00::1").rendezvous_host == "[fd00::1]"


@pytest.mark.parametrize(("env", "message"), [
    ({"LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "l"},
     "LWS_GROUP_SIZE: PDD_TP_SIZE (4) must be a multiple of the group size, got 3"),
    ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2", "LWS_LEADER_ADDRESS": "l"},
     "LWS_WORKER_INDEX: must be < LWS_GROUP_SIZE (2), got 2"),
    ({"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "l"}, "LWS_WORKER_INDEX: required"),
    ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}, "LWS_LEADER_ADDRESS: required"),
    ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "l",
      "PDD_RANKS_PER_POD": "4"}, "PDD_RANKS_PER_POD: must be PDD_TP_SIZE / LWS_GROUP_SIZE = 2"),
    ({"PDD_RANKS_PER_POD": "2"}, "PDD_RANKS_PER_POD: 2 ranks per pod need LWS_GROUP_SIZE"),
    ({"LWS_GROUP_SIZE": "two"}, "LWS_GROUP_SIZE: must be an integer, got 'two'"),
])
def test_an_inconsistent_group_is_refused_naming_the_variable(
        env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _settings(**env)


def test_rank_endpoints_are_signed_when_present() -> None:
    key = b"k" * 32
    grant = sign({"request_id": "r", "instance_id": "i", "host": "h", "side_channel_port": 1,
                  "tp": 2, "dcp": 2, "block_size": 16, "block_ids": [0], "num_tokens": 3,
                  "plan_digest": "d", "epoch": 1, "expires_at": 4e9,
                  "rank_endpoints": [["h", 1], ["w", 2]]}, key)
    verify(grant, key)
    for changed in ({**grant, "rank_endpoints": [["h", 1], ["x", 2]]},
                    {k: v for k, v in grant.items() if k != "rank_endpoints"}):
        with pytest.raises(GrantError, match="signature does not match"):
            verify(changed, key)
    plain = sign({k: v for k, v in grant.items() if k not in ("rank_endpoints", "signature")},
                 key)
    verify(plain, key)
    with pytest.raises(GrantError, match="signature does not match"):
        verify({**plain, "rank_endpoints": [["h", 1], ["w", 2]]}, key)
