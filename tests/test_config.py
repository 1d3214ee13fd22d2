import math

import pytest

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.vmm.spec import HOST_PAGE


def test_defaults_validate():
    cfg = make_config()
    assert cfg.backend == "paged" and cfg.page_size % HOST_PAGE == 0


@pytest.mark.parametrize("overrides, message", [
    ({"page_size": 3000}, f"page_size 3000 is not a multiple of the host page size {HOST_PAGE}"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"kv_cache_bytes": -1}, "kv_cache_bytes must be a positive integer"),
    ({"backend": "nope"}, "unknown backend 'nope'"),
    ({"preemption_mode": "drop"}, "unknown preemption_mode"),
    ({"dtype": "int8"}, "unknown dtype"),
    ({"watermark": 1.5}, "watermark must be a fraction"),
    ({"watermark": math.nan}, "watermark must be a fraction"),
    ({"device": "tpu"}, "unknown device"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 8}, "max_num_batched_tokens (8) must be >="),
    ({"colour": "red"}, "unknown config key(s): colour"),
    ({"vmm_single_range": "yes"}, "vmm_single_range must be true or false"),
])
def test_bad_values_give_actionable_messages(overrides, message):
    with pytest.raises(ConfigError) as err:
        make_config(**overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('[engine]\nbackend = "vmm"\npage_size = 8192\nmax_num_seqs = 8\n')
    cfg = make_config(path, max_num_seqs=4, block_size=None)
    assert (cfg.backend, cfg.page_size, cfg.max_num_seqs, cfg.block_size) == ("vmm", 8192, 4, 16)
    assert cfg.vmm_single_range is False
    path.write_text('[engine]\nvmm_single_range = true\n')
    assert make_config(path).vmm_single_range is True


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        make_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("backend = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        make_config(bad)


def test_replace_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown config key"):
        make_config().replace(nonsense=1)
    assert make_config().replace(backend="reserve").backend == "reserve"
