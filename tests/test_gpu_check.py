"""The GPU check's harness on this CPU (issue 18): GPU presence is decided by nvidia-smi or a torch probe,
never by a part's result, and no GPU without --dry-run-cpu is a loud error; a part killed on timeout keeps
the result it had written; the first-contact selection's dry run."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.gpu import check as gpu_check
from kvlab.experiments.gpu import detect, harness
from kvlab.experiments.gpu.parts_handoff import part_handoff_copy
from kvlab.experiments.gpu.parts_vmm_sizes import part_vmm_sizes
from kvlab.experiments.sim.serve.costs import extrapolated, known_profile
from kvlab.experiments.sim.serve.costs import profile as driver_profile

ROOT = Path(__file__).resolve().parents[1]


def fake_nvidia_smi(bin_dir: Path, body: str) -> None:
    """An executable `nvidia-smi` shell script with `body`, first on PATH for the test."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def no_probe(timeout: float = 0) -> tuple[int | None, str]:
    raise AssertionError("the torch probe must not run when nvidia-smi lists a GPU")


# -- presence ------------------------------------------------------------------------------------------------------
def test_nvidia_smi_listing_a_gpu_decides_presence(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path / "bin", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(detect, "torch_probe", no_probe)
    gpu = detect.detect_gpu()
    assert gpu["present"] and gpu["gpus"] == ["GPU 0: NVIDIA H200 (UUID: GPU-1234)"]


@pytest.mark.parametrize("body", ['echo "No devices were found"; exit 6', "exec sleep 5"], ids=["no-devices", "hangs"])
def test_nvidia_smi_without_an_answer_defers_to_the_torch_probe(body, tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(detect.nvidia_smi_gpus, "__defaults__", (1,))      # a 1 s timeout
    probed = []
    monkeypatch.setattr(detect, "torch_probe", lambda timeout=0: probed.append(1) or (1, "device_count() = 1"))
    gpu = detect.detect_gpu()
    assert probed and gpu["present"] and len(gpu["evidence"]) == 2
    assert "exited with 6" in gpu["evidence"][0] or "did not answer" in gpu["evidence"][0]


def test_the_torch_probe_on_this_cpu_finds_no_gpu():
    count, why = detect.torch_probe(timeout=120)
    assert count == 0, why


def test_no_gpu_without_dry_run_is_a_loud_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "detect_gpu", lambda: {"present": False, "gpus": [],
                                                         "evidence": ["nvidia-smi is not on PATH", "count 0"]})
    monkeypatch.setattr(gpu_check, "run_part", lambda *a: pytest.fail("no part may run, least of all a dry one"))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "no GPU found" in err[0] and "--dry-run-cpu" in err[0]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "no-gpu" and doc["parts"] == {}


def test_a_present_gpu_runs_every_part_compiled_even_if_environment_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "detect_gpu", lambda: {"present": True, "gpus": ["GPU 0: H200"], "evidence": []})
    ran = []

    def fake_run_part(name, dry, timeout):
        ran.append((name, dry))
        return {"ok": name != "environment", "error": "timed out after 60 s"}     # a slow cold start
    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    assert gpu_check.main(["--out", str(tmp_path / "c.json"), "--parts", "cuda_vmm,environment"]) == 1
    assert ran == [("environment", False), ("cuda_vmm", False)]
    assert json.loads((tmp_path / "c.json").read_text())["mode"] == "gpu"


# -- a part killed on timeout keeps its written result -------------------------------------------------------------
def test_a_part_that_wrote_its_result_then_hung_keeps_it(tmp_path):
    result = tmp_path / "part.json"
    # writes its result, then hangs in a child that holds the pipes (as a stuck CUDA teardown would)
    code = (f"import json, subprocess; open({str(result)!r}, 'w').write(json.dumps({{'ok': True, "
            f"'result': {{'faulted': True}}}})); subprocess.run(['sleep', '60'])")
    t0 = time.perf_counter()
    doc = harness.run_subprocess([sys.executable, "-c", code], dict(os.environ), 3, result)
    assert time.perf_counter() - t0 < 30
    assert doc["ok"] and doc["result"] == {"faulted": True} and "killed after 3 s" in doc["timed_out"]


def test_a_part_that_hung_before_writing_is_a_timeout(tmp_path):
    doc = harness.run_subprocess([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), 2,
                                   tmp_path / "part.json")
    assert not doc["ok"] and doc["error"] == "timed out after 2 s and wrote no result"


def test_gpu_check_sh_prefers_the_given_then_the_project_interpreter(tmp_path):
    """$PYTHON if set, else .venv/bin/python, else python3 (issue 19.1): checked on a copy of the script."""
    (tmp_path / "experiments").mkdir()
    (tmp_path / "pyproject.toml").write_text("")   # the script finds the checkout's root by it
    script = (ROOT / "experiments" / "gpu_check.sh").read_text().replace("exec timeout --kill-after=5 475 ",
                                                                         "echo ")
    (tmp_path / "experiments" / "gpu_check.sh").write_text(script)
    run = lambda env: subprocess.run(["bash", "experiments/gpu_check.sh"], cwd=tmp_path, capture_output=True,
                                     text=True, env=env, check=True).stdout.split()[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    assert run(env) == "python3"
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.write_text("")
    venv_python.chmod(0o755)
    assert run(env) == ".venv/bin/python"
    assert run({**env, "PYTHON": "/opt/py"}) == "/opt/py"


# -- the first-contact selection -----------------------------------------------------------------------------------
def test_the_script_runs_parts_in_their_own_processes_on_cpu(tmp_path):
    """make test's representative of the dry runs below: the script, two parts, one JSON document."""
    out = tmp_path / "two.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh"), "--dry-run-cpu", "--parts",
                           "environment,vmm_round_trip", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    doc = json.loads(out.read_text())
    assert proc.returncode == 0, {k: v.get("error") for k, v in doc["parts"].items()}
    assert doc["mode"] == "cpu-dry-run" and list(doc["parts"]) == ["environment", "vmm_round_trip"]
    assert doc["parts"]["vmm_round_trip"]["result"]["fake_leaks"] == {}


@pytest.mark.slow      # ~25 s: eight parts, each in a process of its own
def test_first_contact_dry_run_runs_every_part_on_cpu(tmp_path):
    out = tmp_path / "first_contact.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh"), "--first-contact", "--dry-run-cpu",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    doc = json.loads(out.read_text())
    parts = doc["parts"]
    assert proc.returncode == 0, {k: v.get("error") for k, v in parts.items()}
    assert doc["mode"] == "cpu-dry-run" and doc["selection"] == "first-contact"
    assert list(parts) == ["environment", "unmapped_view", "vmm_round_trip", "vmm_latency", "vmm_sizes",
                           "vmm_cache", "triton_kernel", "unmapped_access"]
    versions = parts["environment"]["result"]
    assert versions["minimum_granularity"] == versions["recommended_granularity"] == 2 * 2**20
    assert {"torch", "triton", "numpy", "cuda.bindings", "driver"} <= set(versions)
    trip = parts["vmm_round_trip"]["result"]
    assert trip["fake_leaks"] == {}
    assert trip["worker_thread"] == {"without_context": "CUDA_ERROR_INVALID_CONTEXT", "with_primary_context": "ok"}
    for dtype, row in parts["vmm_cache"]["result"]["dtypes"].items():
        assert row["ok"] and row["kernels"]["decode"] and row["runtime_fallbacks"] == [], dtype
    assert all(c["ok"] and c["max_abs_err"] < 1e-4 for c in parts["triton_kernel"]["result"]["configs"])
    latency = parts["vmm_latency"]["result"]
    assert latency["pages"] == 16 and set(latency["us"]) == {"create", "map", "set_access", "unmap", "release"}
    assert parts["vmm_sizes"]["result"]["driver_figures"]["format"] == "kvlab-driver-figures/1"
    assert parts["unmapped_access"]["result"]["ran"] is False


def test_first_contact_without_a_gpu_is_a_loud_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "detect_gpu", lambda: {"present": False, "gpus": [], "evidence": ["none"]})
    monkeypatch.setattr(gpu_check, "run_part", lambda *a: pytest.fail("no part may run"))
    assert gpu_check.main(["--first-contact", "--out", str(tmp_path / "f.json")]) == 2
    assert "--dry-run-cpu" in capsys.readouterr().err
    assert json.loads((tmp_path / "f.json").read_text())["mode"] == "no-gpu"


def test_an_unknown_part_is_one_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "run_part", lambda *a: pytest.fail("no part may run"))
    assert gpu_check.main(["--dry-run-cpu", "--parts", "environment,nope", "--out", str(tmp_path / "g.json")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "unknown part(s) nope" in err[0] and "cuda_vmm" in err[0]


# -- the measuring parts' dry runs and the driver figures they feed (measured:FILE) --------------------------------
MiB = 2**20


def figures_check(tmp_path, points, ok=True):
    """A synthetic gpu_check.json whose vmm_sizes part holds `points`."""
    doc = {"mode": "gpu", "parts": {"vmm_sizes": {"ok": ok, "result": {"driver_figures": {
        "format": "kvlab-driver-figures/1", "page_bytes": 2 * MiB, "source": "synthetic", "points": points}}}}}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(doc))
    return f"measured:{path}"


def point(mib, us):
    return {"bytes": mib * MiB, "create_s": 4 * us * 1e-6, "map_s": us * 1e-6, "set_access_s": 2 * us * 1e-6,
            "unmap_s": 3 * us * 1e-6}


def test_measured_driver_figures_at_a_page_size(tmp_path):
    spec = figures_check(tmp_path, [point(2, 1.0), point(8, 3.0), point(32, 10.0)])
    assert known_profile(spec) and not known_profile("measured:") and not known_profile("bogus")
    at_8 = driver_profile(spec, None, 8 * MiB)
    assert (at_8.map_s, at_8.set_access_s, at_8.unmap_s, at_8.create_s) == pytest.approx((3e-6, 6e-6, 9e-6, 12e-6))
    at_4 = driver_profile(spec, None, 4 * MiB)          # halfway between 2 and 8 MiB in log2(bytes)
    assert at_4.map_s == pytest.approx(2e-6) and at_4.name == "measured" and "synthetic" in at_4.source
    assert driver_profile(spec, None, 64 * MiB).map_s == pytest.approx(10e-6)        # held beyond the largest
    small = driver_profile(spec, None, 256 * 1024)                                  # 2 MiB figures, marked
    assert small.map_s == pytest.approx(1e-6) and extrapolated(small, 256 * 1024)
    assert not extrapolated(at_4, 4 * MiB)


@pytest.mark.parametrize("points, ok, why", [
    ([point(2, 1.0)], False, "without a successful vmm_sizes part"),
    ([], True, "without points"),
    ([{**point(2, 1.0), "map_s": -1}], True, "map_s must be a non-negative number"),
    ([{**point(2, 1.0), "bytes": 0}], True, "bytes must be a positive number"),
])
def test_bad_driver_figures_are_one_line(tmp_path, points, ok, why):
    with pytest.raises(ConfigError, match=why) as err:
        driver_profile(figures_check(tmp_path, points, ok), None, 2 * MiB)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no driver figures at"):
        driver_profile(f"measured:{tmp_path / 'missing.json'}", None, 2 * MiB)


def test_vmm_sizes_dry_run_feeds_the_driver_profile(tmp_path):
    result = part_vmm_sizes(True)
    assert result["fake_leaks"] == {} and [r["pages"] for r in result["sizes"]] == [1, 2, 4]
    for row in result["sizes"]:
        handles = row["page_handles"]
        assert set(row["one_handle"]) == {"create_us", "map_us", "set_access_us", "unmap_us"}
        assert handles["set_access_per_run_us"] > 0 and handles["unmap_per_run_us"] > 0
        assert handles["map_us_per_call"] == pytest.approx(handles["map_per_page_total_us"] / row["pages"])
    doc = {"parts": {"vmm_sizes": {"ok": True, "result": result}}}
    (tmp_path / "g.json").write_text(json.dumps(doc))
    got = driver_profile(f"measured:{tmp_path / 'g.json'}", None, 4 * MiB)
    assert got.unmap_s == pytest.approx(result["sizes"][1]["one_handle"]["unmap_us"] / 1e6)


def test_handoff_copy_dry_run():
    result = part_handoff_copy(True)
    assert result["fake_leaks"] == {} and [r["pages"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["copy"]["blocks"] == row["bytes"] // result["block_bytes"]
        assert set(row["remap"]) >= {"export_us_median", "import_us_median", "map_and_set_access_us_median"}


def test_a_measuring_part_past_its_deadline_says_what_it_did_not_measure(monkeypatch):
    monkeypatch.setenv(harness.PART_TIMEOUT_ENV, "0")          # the deadline is now: no point is started
    sizes = part_vmm_sizes(True)
    assert sizes["sizes"] == [] and sizes["not_measured_time_budget"] == [1, 2, 4] and sizes["fake_leaks"] == {}
    assert "no range size measured" in sizes["failed"]
    handoff = part_handoff_copy(True)
    assert all("not_measured" in row for row in handoff["rows"]) and handoff["fake_leaks"] == {}
    assert "no size measured" in handoff["failed"]


# -- the elastic backend's CUDA path (experiments/gpu/parts_elastic.py) -----------------------------------------------
def test_elastic_block_pool_dry_run_maps_what_the_blocks_hold():
    """The part's block-pool half on the fake driver: memory follows the blocks at every step, a drained pool maps
    nothing, the fake holds nothing after, and torch's factories are torch's again."""
    import torch

    from kvlab.experiments.gpu.parts_elastic import block_pool
    factories = torch.as_tensor, torch.from_dlpack
    out = block_pool(True)
    assert "problems" not in out, out["problems"]
    assert out["fake_leaks"] == {} and (torch.as_tensor, torch.from_dlpack) == factories
    assert out["page_size"] == 2 * 2**20 and out["peak_mapped_pages"] > 0 and out["steps"][-1]["mapped_pages"] == 0
    assert out["steps"][5]["mapped_chunks"] > out["steps"][0]["mapped_chunks"]     # growth maps chunk by chunk


def test_elastic_block_pool_dry_run_sees_memory_that_stays_behind(monkeypatch):
    """Chunks unmapped but their pages never given back: the part says so (a check that can fail)."""
    from kvlab.elastic.memory import ElasticMemory
    from kvlab.experiments.gpu.parts_elastic import block_pool
    monkeypatch.setattr(ElasticMemory, "unmap_chunk", lambda self, chunk: self.driver.unmap_mirrored(
        self.mirror, chunk * self.geo.chunk_bytes, self.geo.pages_of(chunk)))
    out = block_pool(True)
    assert any("physical handles live for" in p for p in out["problems"]), out.get("problems")
