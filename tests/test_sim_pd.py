"""`kvlab simulate pd`: the handoff's arithmetic by hand (a copy of B bytes at W bytes/s takes B / W; a remap is a
map per page and an access grant per tensor), the page geometry against the vmm backend's own, and small runs."""
import pytest

from kvlab.common.config import make_config
from kvlab.common.kv.seam import create_cache
from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.gpu_figures import LINKS, Link
from kvlab.experiments.sim.pd.handoff import Handoff, pages, tokens_per_page
from kvlab.experiments.sim.pd.run import SAME_DEVICE, Channel, PdSpec, Setup, make_handoff, run_point
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.serve.costs import CUDA_A100
from kvlab.experiments.sim.serve.run import ServeSpec, parse_backends

LLAMA = model_spec("llama3-8b")
SMALL = ServeSpec(num_requests=60, dataset="random", input_len=300, output_len=20, range_ratio=0.5,
                  model_prefill=True, driver_profile="cuda-a100")


def test_a_copy_of_b_bytes_at_w_costs_b_over_w():
    h = Handoff(LLAMA, link=Link("test", 1e9, "a round figure"))
    assert LLAMA.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2                   # 128 KiB per token, bf16
    assert h.seconds(1000) == pytest.approx(1000 * 131072 / 1e9)
    assert h.bytes_copied(1000) == 131_072_000 and h.units_moved(1000) == 0 and h.sender_seconds(1000) == 0
    assert Handoff(LLAMA, link=LINKS["nvlink"]).seconds(32768) == pytest.approx(32768 * 131072 / 450e9)
    assert Handoff(LLAMA, link=LINKS["pcie"]).seconds(32768) == pytest.approx(32768 * 131072 / 64e9)


def test_a_remap_is_a_map_per_page_and_a_grant_per_tensor():
    h = Handoff(LLAMA, page_size=2 << 20, costs=CUDA_A100)
    assert tokens_per_page(2 << 20, LLAMA) == 1024 and tokens_per_page(64 << 10, LLAMA) == 32
    assert pages(1024, 2 << 20, LLAMA) == 64 and pages(1025, 2 << 20, LLAMA) == 128
    assert h.seconds(1025) == pytest.approx(128 * 1.45e-6 + 64 * 36e-6)
    assert h.sender_seconds(1025) == pytest.approx(128 * (25.6e-6 + 1.45e-6) + 64 * 36e-6)
    assert h.bytes_copied(1025) == 0 and h.units_moved(1025) == 128


def test_a_channel_books_each_handoff_in_the_earliest_gap():
    c = Channel()
    assert c.book(0, 1) == 1 and c.book(5, 1) == 6
    assert c.book(0.5, 1) == 2                 # queued behind the first
    assert c.book(1.5, 3) == 5                 # fits exactly between 2 and 5
    assert c.book(0, 0.5) == 6.5               # no gap left before 6
    assert c.busy == [(0, 1), (1, 2), (2, 5), (5, 6), (6, 6.5)]


@pytest.mark.parametrize("page_size", [2 << 20, 64 << 10])
def test_page_geometry_is_the_vmm_backends(page_size):
    config = make_config(backend="vmm", kv_cache_bytes=4 << 30, page_size=page_size, max_model_len=4096,
                         device="cpu")
    cache = create_cache(config, LLAMA.kv_shape(), accounting_only=True)
    try:
        geo = cache.allocator.geo
        assert geo.tokens_per_page == tokens_per_page(page_size, LLAMA) and geo.num_tensors == 64
    finally:
        cache.close()


def test_disaggregated_runs_hand_every_multi_token_request_over():
    paged, vmm = parse_backends(["paged-16", "vmm-2MiB"], 20.0, 0.05)
    spec = PdSpec(SMALL, prefill=1, decode=1)
    colocated = run_point(Setup(paged), spec, 5.0, 0)
    copied = run_point(Setup(paged, "nvlink"), spec, 5.0, 0)
    remapped = run_point(Setup(vmm, "remap", arrangement=SAME_DEVICE), spec, 5.0, 0)
    for r in (colocated, copied, remapped):
        assert r["completed"] == 60 and r["failed"] == 0
    assert copied["total_output_tokens"] == colocated["total_output_tokens"]
    hand = copied["handoff"]
    assert hand["count"] == 60 and hand["units_moved"] == 0
    prompts = copied["total_input_tokens"]
    assert hand["bytes_copied"] == (prompts + 60) * LLAMA.kv_bytes_per_token    # prompt + first token each
    # no handoff is faster than its own copy; queued ones wait for the channel
    assert hand["seconds"] >= hand["bytes_copied"] / 450e9 * 0.999
    assert remapped["handoff"]["bytes_copied"] == 0 and remapped["handoff"]["units_moved"] > 0
    assert copied["p99_ttft_ms"] > 0 and copied["p99_tpot_ms"] > 0


def test_a_slower_link_never_helps():
    paged = parse_backends(["paged-16"], 20.0, 0.05)[0]
    spec = PdSpec(SMALL, prefill=1, decode=1)
    fast, slow = (run_point(Setup(paged, name), spec, 8.0, 1) for name in ("nvlink", "pcie"))
    assert slow["handoff"]["seconds"] > fast["handoff"]["seconds"]
    assert slow["mean_e2el_ms"] >= fast["mean_e2el_ms"]


COMMON = ["simulate", "pd", "--num-prompts", "40", "--dataset", "random", "--input-len", "300", "--output-len", "20",
          "--budget-gb", "20", "--links", "nvlink", "--jobs", "1", "--no-progress"]


def test_cli_handoff_table_and_grid(capsys):
    assert main(["simulate", "pd", "--handoff-table", "--set-access", "per-run"]) == 0
    out = capsys.readouterr().out
    assert "32,768" in out and "9.54 ms / 4.29 GB" in out and "67.1 ms" in out and "5.27 ms / 0 GB" in out
    # per-page cuMemSetAccess (the default): 2,048 pages x (1.45 + 36) us for a 32K-token prompt
    assert main(["simulate", "pd", "--handoff-table"]) == 0
    assert "76.7 ms / 0 GB" in capsys.readouterr().out
    assert main([*COMMON, "--request-rates", "4", "--no-save"]) == 0
    assert "pd copy/nvlink paged-16" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_search(tmp_path, capsys):
    assert main([*COMMON, "--backends", "vmm-2MiB", "--slo", "p99_ttft_ms<=2000,p99_tpot_ms<=100",
                 "--slo-tolerance", "0.3", "--out", str(tmp_path / "new" / "dir")]) == 0
    assert "pd remap vmm-2MiB" in capsys.readouterr().out and (tmp_path / "new" / "dir" / "sim_pd.json").is_file()


@pytest.mark.parametrize("argv,fragment", [
    (["--links", "infiniband"], "unknown link 'infiniband'"),
    (["--backends", "reserve"], "compares paged (copy) and vmm (remap, copy, remote)"),
    (["--arrangements", "same-device", "--decode", "2"], "--prefill = --decode"),
    (["--vmm-handoffs", "teleport"], "unknown --vmm-handoffs"),
    (["--prefill", "0"], "--prefill"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--driver-costs", "host"], "unknown --driver-costs"),
])
def test_errors_are_one_line(argv, fragment, capsys):
    assert main(["simulate", "pd", "--no-save", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]


def test_cross_device_copy_costs_scale_with_transfers():
    paged, vmm = parse_backends(["paged-16", "vmm-2MiB"], 20.0, 0.05)
    spec = PdSpec(SMALL, transfer_overhead_s=1e-6)
    blocks, ranges = (make_handoff(Setup(c, "copy", "nvlink"), spec) for c in (paged, vmm))
    assert blocks.transfers(1024) == 64 * 64 and ranges.transfers(1024) == 64      # 16-token blocks vs one range
    assert blocks.bytes_copied(1024) == ranges.bytes_copied(1024)
    by_bytes = 1024 * LLAMA.kv_bytes_per_token / 450e9
    assert blocks.seconds(1024) == pytest.approx(by_bytes + 4096e-6)
    assert ranges.seconds(1024) == pytest.approx(by_bytes + 64e-6)
    assert blocks.seconds(2048) - by_bytes * 2 == pytest.approx(2 * (blocks.seconds(1024) - by_bytes))


def test_same_device_remap_copies_nothing_and_background_mapping_hides_the_senders_driver_time():
    vmm = parse_backends(["vmm-2MiB"], 20.0, 0.05)[0]
    on = make_handoff(Setup(vmm, "remap", arrangement=SAME_DEVICE), PdSpec(SMALL))
    off = make_handoff(Setup(vmm, "remap", arrangement=SAME_DEVICE),
                       PdSpec(ServeSpec(driver_profile="cuda-a100", background_mapping=False)))
    assert on.bytes_copied(4096) == 0 and on.transfers(4096) == 0
    assert on.seconds(4096) == pytest.approx(4 * 64 * (1.45e-6 + 36e-6))              # per page: map + grant
    assert on.sender_seconds(4096) == 0 and on.hidden_sender_seconds(4096) > 0
    assert off.sender_seconds(4096) == pytest.approx(on.hidden_sender_seconds(4096))
    with pytest.raises(ValueError, match="same-device"):
        Setup(vmm, "remap")


def test_cross_layer_halves_map_calls_and_more():
    per, cross = parse_backends(["vmm-2MiB", "vmm-2MiB-crosslayer"], 20.0, 0.05)
    assert cross.backend_label == "vmm-2MiB-crosslayer" and tokens_per_page(2 << 20, LLAMA, "cross-layer") == 32
    p, c = (make_handoff(Setup(x, "remap", arrangement=SAME_DEVICE), PdSpec(SMALL)) for x in (per, cross))
    # the same 1,024 tokens: 64 per-layer pages (one per tensor) or 2 x 32 cross-layer pages, all 2 MiB
    assert p.units_moved(1024) == 64 and c.units_moved(1024) == 64
    assert p.units_moved(32) == 64 and c.units_moved(32) == 2          # a short prompt strands far less


def test_remote_pages_pay_link_reads_every_decode_step():
    vmm = parse_backends(["vmm-2MiB"], 20.0, 0.05)[0]
    spec = PdSpec(SMALL)
    copied = run_point(Setup(vmm, "copy", "nvlink"), spec, 5.0, 0)
    remote = run_point(Setup(vmm, "remote", "nvlink"), spec, 5.0, 0)
    assert remote["handoff"]["remote_read_seconds"] > 0 and copied["handoff"]["remote_read_seconds"] == 0
    assert remote["handoff"]["bytes_copied"] == 0 and remote["mean_tpot_ms"] > copied["mean_tpot_ms"]
