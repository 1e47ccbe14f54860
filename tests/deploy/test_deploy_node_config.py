"""Site configuration through a SuperNode's ``--node-config`` (deployment).

The node config string is parsed by Flower's own parser (what ``flower-supernode --node-config``
uses) and validated by :class:`clients.settings.NodeConfig` at the site's first message; errors
name the node and the field. Real Flower Message / Context objects, nothing mocked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.config import parse_config_args

from clients.settings import SiteSettings
from fedagg.builtin import builtin_task
from fedagg.config import RunConfig
from fedagg.errors import ConfigError, DataError
from server.runner import client_config

NODE_ID = 4242


def _settings(node_config: str) -> SiteSettings:
    msg = Message(content=RecordDict({"config": client_config(RunConfig())}), dst_node_id=NODE_ID,
                  message_type="train")
    ctx = Context(run_id=1, node_id=NODE_ID, node_config=parse_config_args([node_config]),
                  state=RecordDict(), run_config={})
    return SiteSettings.from_message(msg, ctx)


def test_site_settings_from_node_config_override_the_run_config() -> None:
    s = _settings("site-name='lab-a' workers=2 mode='process' algorithm='ring' "
                  "partition-id=1 num-partitions=3")
    assert s.name == "lab-a"
    assert (s.cfg.site.workers, s.cfg.site.mode, s.cfg.site.algorithm) == (2, "process", "ring")
    assert (s.partition_id, s.num_partitions) == (1, 3)


@pytest.mark.parametrize(("node_config", "field"), [
    ("worker=4", "node_config.worker"),                 # typo: unknown key
    ("workers=0", "node_config.workers"),               # out of range
    ("mode='gpu'", "node_config.mode"),                 # not an allowed value
    ("algorithm='butterfly'", "node_config.algorithm"),
    ("partition-id=-1", "node_config.partition_id"),
    ("num-partitions=0", "node_config.num_partitions"),
])
def test_bad_node_config_names_the_node_and_the_field(node_config: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        _settings(node_config)
    text = str(info.value)
    assert text.startswith(f"node {NODE_ID}: {field}"), text
    assert "Fix:" in text


def test_site_data_from_data_path(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((20, 8, 8), dtype=np.float32)
    y = np.arange(20) % 10
    np.savez(tmp_path / "site.npz", x_train=x, y_train=y)
    s = _settings(f"data-path='{tmp_path / 'site.npz'}' site-name='lab-b'")
    task = builtin_task(s.cfg, data_path=s.node.data_path)
    data = task.data(s.site_info())
    assert task.data.shape() == ((1, 8, 8), 10)  # type: ignore[attr-defined]
    xs, ys = data.train.tensors  # type: ignore[union-attr]
    _xe, ye = data.eval.tensors  # type: ignore[union-attr]  # a held-out 10 % (data.eval_fraction)
    assert xs.shape[1:] == (1, 8, 8) and len(ys) + len(ye) == 20 and len(ye) == 2
    assert sorted(ys.tolist() + ye.tolist()) == sorted(y.tolist())


def test_unreadable_data_path_names_the_node(tmp_path: Path) -> None:
    np.savez(tmp_path / "wrong.npz", features=np.zeros(3))
    for path in (tmp_path / "missing.npz", tmp_path / "wrong.npz"):
        s = _settings(f"data-path='{path}'")
        with pytest.raises(DataError, match=rf"node {NODE_ID}: node_config.data_path .*Fix:"):
            builtin_task(s.cfg, data_path=s.node.data_path).data(s.site_info())
