"""``gpu-profile`` without running its driver: records, estimate, table.

The counts themselves are the emulated profile's, checked on kernels with
known answers in tests/mojo/test_profile.mojo; here the command's reading
of the driver's lines, and the estimate worked by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mla_kpool.__main__ import main
from mla_kpool.bench.bounds import WORKLOADS
from mla_kpool.gpu_profile import (
    format_table,
    launch_record,
    parse_lines,
    report_registers,
    verdict,
)
from mla_kpool.gpu_profile.estimate import (
    COST_MODELS,
    estimate_us,
    launch_counts,
)


def _site(site: str, ways: int, requests: int, **more) -> dict:
    return {
        "site": site,
        "access": "store",
        "width_words": 1,
        "requests": requests,
        "wavefronts": ways * requests,
        "ideal_wavefronts": requests,
        "ways": ways,
        "max_lanes_per_address": 0,
        "atomic_lanes": 0,
        "atomic_addresses": 0,
    } | more


def _load(site: str, requests: int, sectors: int, used: int) -> dict:
    """A global load site: ``used`` bytes asked for of its sectors'."""
    return {
        "site": site,
        "access": "load",
        "bytes_per_lane": 4,
        "requests": requests,
        "sectors": sectors,
        "bytes_requested": used,
        "uniform_requests": 0,
        "uniform_sectors": 0,
        "uniform_bytes": 0,
    }


def _launch(kernel: str, *sites: dict, loads: tuple = ()) -> dict:
    requests = sum(s["requests"] for s in sites)
    wavefronts = sum(s["wavefronts"] for s in sites)
    return {
        "op": "index_top_k",
        "workload": "glm5-next-decode",
        "arch": "sm_90a",
        "window_rows": 16,
        "profile": {
            "kernel": kernel,
            "grid": 512,
            "blocks": 16,
            "sampled_blocks": 16,
            "barriers_per_block": 1,
            "block_threads": 256,
            "shared_bytes": 16384,
            "busiest_block_accesses": 900,
            "idlest_block_accesses": 700,
            "phase_path": [1, 4],
            "phase_global": [0, 2],
            "phase_cold": [0, 1],
            "shared": {
                "requests": requests,
                "wavefronts": wavefronts,
                "sites": list(sites),
            },
            "global": {
                "requests": sum(s["requests"] for s in loads),
                "sectors": sum(s["sectors"] for s in loads),
                "cold_sectors": sum(s["sectors"] for s in loads) // 2,
                "bytes_requested": sum(s["bytes_requested"] for s in loads),
                "bytes_read": 1_000_000,
                "bytes_written": 0,
                "sites": list(loads),
            },
        },
    }


CONFLICTED = _launch(
    "mla_kpool_index_score_kernel",
    _site("kernels/index/gpu/score.mojo:332:24", 32, 2048),
    _site("kernels/index/gpu/score.mojo:217:20", 1, 6144),
    # 100 requests of 16 sectors, half of each asked for: 50%.
    loads=(_load("kernels/index/gpu/score.mojo:126:64", 100, 1600, 25600),),
)
CLEAN = _launch(
    "mla_kpool_index_select_kernel",
    _site("kernels/index/gpu/pick.mojo:218:26", 2, 100, buffer="pair_keys"),
    _site(
        "kernels/index/gpu/pick.mojo:358:29",
        1,
        10,
        access="atomic",
        max_lanes_per_address=18,
        atomic_lanes=36,
        atomic_addresses=4,
    ),
    loads=(
        _load("kernels/index/gpu/pick.mojo:152:53", 10, 40, 1280),
        # A value every lane reads: one sector a request, 8 bytes of it.
        _load("kernels/index/gpu/launches.mojo:181:30", 5, 5, 40)
        | {"uniform_requests": 5, "uniform_sectors": 5, "uniform_bytes": 40},
    ),
)


RECORDS = [launch_record(CONFLICTED), launch_record(CLEAN)]


def test_a_record_has_the_documented_fields():
    record = RECORDS[1]
    assert record["kernel"] == "mla_kpool_index_select_kernel"
    assert record["blocks"] == 512 and record["sampled_blocks"] == 16
    assert record["shared"]["worst"][0] == {
        "site": "kernels/index/gpu/pick.mojo:218:26",
        "buffer": "pair_keys",
        "ways": 2,
    }
    # A site of no named buffer (a driver of an older profile) has none.
    assert RECORDS[0]["shared"]["worst"][0]["buffer"] == ""
    # 36 lanes on 4 words: 9 a word on average, 18 at most.
    assert record["atomics"] == {
        "max_lanes_per_address": 18,
        "mean_lanes_per_address": 9.0,
    }
    g = record["global"]
    assert g["load_efficiency"] == 1280 / (32 * 40)
    # 16 of 512 blocks emulated: their distinct bytes, 32 times.
    assert g["launch_bytes"] == 32_000_000
    assert g["bound_bytes"] == WORKLOADS["glm5-next-decode"]["bytes"]
    assert (
        record["busiest_block_accesses"],
        record["idlest_block_accesses"],
    ) == (
        900,
        700,
    )
    assert set(record["estimate_us"]) == {"H100", "H200"}
    assert set(record["waves"]) == {"H100", "H200"}


def test_the_table_names_the_worst_sites_and_the_estimates():
    header, conflicted, clean, *notes = format_table(RECORDS)
    assert header.split()[:11] == [
        "workload", "kernel", "blocks", "bar", "requests", "wf/req", "ways",
        "atomic", "sec/req", "ld", "eff",
    ]  # fmt: skip
    assert header.split()[11:] == [
        "MB", "H100", "us", "H200", "us", "worst", "site",
    ]  # fmt: skip
    # 2,048 requests at 32 wavefronts and 6,144 at 1: 71,680 / 8,192;
    # 1,600 sectors over 100 requests, half of each used.
    cells = conflicted.split()
    assert cells[:11] == [
        "glm5-next-decode", "score_kernel", "16/512", "1", "8,192", "8.75",
        "32", "-", "16.0", "50%", "32.00",
    ]  # fmt: skip
    assert cells[-1] == "kernels/index/gpu/score.mojo:332:24"
    # 100 requests at 2 wavefronts and 10 at 1: 210 / 110; 45 sectors
    # over 15 global requests; the uniform ones not in the efficiency.
    assert clean.split()[5:10] == ["1.91", "2", "18", "3.0", "100%"]
    # A site of a named buffer says which.
    assert clean.endswith("kernels/index/gpu/pick.mojo:218:26 (pair_keys)")
    assert notes == [
        "  32-way: kernels/index/gpu/score.mojo:332:24 (store, 4"
        " bytes a lane; 2,048 requests, 65,536 wavefronts for 2,048) in"
        " glm5-next-decode mla_kpool_index_score_kernel",
        "  50% of sectors used: kernels/index/gpu/score.mojo:126:64"
        " (load, 4 bytes a lane; 100 requests, 16.0 sectors each) in"
        " glm5-next-decode mla_kpool_index_score_kernel",
    ]


def test_the_verdict_names_what_is_not_clean():
    assert verdict([RECORDS[1]]) == (
        "verdict: 1 launches, every shared site at most 2-way, every"
        " launch's loads at least 80% of their sectors"
    )
    assert verdict([RECORDS[0], RECORDS[1], RECORDS[0]]) == (
        "verdict: 1 kernels with a shared site past 2-way:"
        " mla_kpool_index_score_kernel; 1 kernels whose loads use under 80%"
        " of their sectors: mla_kpool_index_score_kernel"
    )


def _bare(**more) -> dict:
    """A launch of 132 blocks of 256 threads, every block emulated, with
    no shared memory: phase 0 reads global memory, phase 1 only waits."""
    return {
        "grid": 132,
        "blocks": 132,
        "block_threads": 256,
        "shared_bytes": 0,
        "phase_path": [0, 0],
        "phase_global": [1, 0],
        "phase_cold": [1, 0],
        "shared": {"requests": 0, "wavefronts": 0, "sites": []},
        "global": {
            "requests": 0,
            "sectors": 0,
            "cold_sectors": 0,
            "bytes_requested": 0,
            "bytes_read": 3_350_000,
            "bytes_written": 0,
            "sites": [],
        },
    } | more


def test_the_estimate_by_hand():
    h100 = COST_MODELS["H100"]
    est = estimate_us(_bare(), h100)
    # 3.35 MB at 3.35 TB/s: 1 us. One wave (8 blocks of 8 warps fit an
    # SM); phase 0: barrier 40 + HBM latency 480 + one access at 4 cycles,
    # phase 1: barrier 40; 564 cycles at 1.98 GHz.
    assert est["waves"] == 1
    assert est["dram"] == pytest.approx(1.0)
    assert est["latency"] == pytest.approx(564 / 1980)
    assert est["us"] == pytest.approx(2.0 + 1.0 + 564 / 1980)
    # The H200's HBM moves the same bytes at 4.8 TB/s.
    h200 = estimate_us(_bare(), COST_MODELS["H200"])
    assert h200["dram"] == pytest.approx(3.35 / 4.8)
    # 1,056 blocks: 8 a SM resident, 1 wave; 1,057: 2 waves.
    assert estimate_us(_bare(grid=1057, blocks=1057), h100)["waves"] == 2
    # Registers limit residency: 255 a thread leaves one 256-thread block
    # an SM, 132 blocks a wave.
    assert estimate_us(_bare(grid=264, blocks=264), h100, 255)["waves"] == 2


def test_a_thread_waits_for_each_of_its_accesses_in_turn():
    # Phase 0's busiest thread: 3 global accesses, 1 of them cold, and 2
    # shared: 480 + 2 * 40 (L1 hits) + 2 * 30, issue 5 * 4, barrier 40;
    # phase 1: barrier 40. 720 cycles at 1.98 GHz.
    chain = _bare(phase_path=[2, 0], phase_global=[3, 0], phase_cold=[1, 0])
    est = estimate_us(chain, COST_MODELS["H100"])
    assert est["latency"] == pytest.approx(720 / 1980)
    # Twice the chain, twice its latency less the barriers'.
    longer = _bare(phase_path=[4, 0], phase_global=[6, 0], phase_cold=[2, 0])
    assert estimate_us(longer, COST_MODELS["H100"])["latency"] == (
        pytest.approx((720 + 640) / 1980)
    )


def test_l2_traffic_is_the_sectors_blocks_touch_first():
    # 171,875 sectors of 32 bytes: 5.5 MB at 5.5 TB/s, 1 us; sectors a
    # block touched before are its L1's.
    bare = _bare()
    bare["global"] |= {"sectors": 10**6, "cold_sectors": 171_875}
    assert estimate_us(bare, COST_MODELS["H100"])["l2"] == pytest.approx(1.0)


def test_the_estimate_scales_a_sampled_launch():
    sampled = _bare(grid=1320, blocks=132)
    assert launch_counts(sampled)["dram_bytes"] == 33_500_000
    assert estimate_us(sampled, COST_MODELS["H100"])["dram"] == (
        pytest.approx(10.0)
    )


def test_the_driver_lines_are_json_objects():
    text = json.dumps(CLEAN) + "\n\n" + json.dumps(CONFLICTED) + "\n"
    assert parse_lines(text) == [CLEAN, CONFLICTED]


SELECT = "mla_kpool_index_select_kernel"


def test_registers_come_from_a_gpu_report_json(tmp_path):
    report = tmp_path / "r.json"
    report.write_text(
        json.dumps(
            {
                "kernels": [
                    {
                        "arch": "sm_90a",
                        "entry": f"{SELECT}_01dd432a",
                        "registers": 40,
                    },
                    {
                        "arch": "sm_90a",
                        "entry": f"{SELECT}_76c5579d",
                        "registers": 128,
                    },
                    {
                        "arch": "gfx942",
                        "entry": f"{SELECT}_01dd432a",
                        "registers": 90,
                    },
                    {
                        "arch": "sm_90a",
                        "entry": "j_0123abcd",
                        "registers": None,
                    },
                ]
            }
        )
    )
    # Keyed by the launches' kernel names, as the profile's records have
    # them, the most of the kernel's configurations.
    registers = report_registers(str(report), "sm_90a")
    assert registers == {SELECT: 128}
    assert CLEAN["profile"]["kernel"] == SELECT
    # 56 registers x 512 threads leave two select blocks an SM, where the
    # register limit lifted leaves four: the estimate takes them.
    assert (
        launch_record(CLEAN, registers)["waves"]
        != (launch_record(CLEAN)["waves"])
    )
    # A report of other targets says so rather than being ignored.
    with pytest.raises(ValueError, match="no sm_100a kernel.*gfx942, sm_90a"):
        report_registers(str(report), "sm_100a")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{}", "not gpu-report's JSON"),
        ("[1, 2]", "not gpu-report's JSON"),
        ("\xff\xfe", "not JSON"),
        ('{"kernels": [{"arch": "gfx942", "registers": 9}]}', "no sm_90a"),
    ],
)
def test_a_bad_report_is_a_usage_error(text, message, tmp_path, capsys):
    report = tmp_path / "r.json"
    report.write_bytes(text.encode("latin-1"))
    argv = ["gpu-profile", "--report", str(report)]
    assert main(argv, prog="python -m mla_kpool") == 2
    err = capsys.readouterr().err
    assert f"argument --report: {report}: " in err and message in err, err
    assert "Traceback" not in err


def test_a_closed_pipe_ends_the_table_quietly(tmp_path):
    """``gpu-profile | head -1``: the stand-in driver's launches printed
    into a pipe the reader closes after one line; no traceback, status 0."""
    fake = tmp_path / "mojo"
    lines = "\n".join(json.dumps(x) for x in [CONFLICTED, CLEAN] * 200)
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
    fake.chmod(0o755)
    script = (
        "import mla_kpool.gpu_profile as g, sys;"
        f"g.mojo_command = lambda: {str(fake)!r};"
        "from mla_kpool.__main__ import main; sys.exit(main(['gpu-profile']))"
    )
    proc = subprocess.run(
        f'{sys.executable} -c "{script}" | head -1',
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("workload"), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sample", "0"], "argument --sample: must be >= 1, got 0"),
        (["--sample", "257"], "argument --sample: must be at most 256"),
        (["--arch", "sm_100a"], "argument --arch: invalid choice"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options_exit_2_before_running(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gpu-profile", *argv], prog="python -m mla_kpool")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m mla_kpool gpu-profile")
    assert message in err


def test_the_command_streams_the_drivers_launches(
    tmp_path, monkeypatch, capsys
):
    """A stand-in for ``mojo`` that prints two launches: the table, the
    verdict, the count, and the JSON of both."""
    import mla_kpool.gpu_profile as gpu_profile

    fake = tmp_path / "mojo"
    lines = "\n".join(json.dumps(x) for x in (CONFLICTED, CLEAN))
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_profile, "mojo_command", lambda: str(fake))
    out_json = tmp_path / "p.json"
    assert main(["gpu-profile", "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[1].startswith("glm5-next-decode  score_kernel")
    assert out[-1] == verdict(RECORDS)
    # The legend before the verdict says what each column counts.
    assert out[-2] == gpu_profile.LEGEND and "wf/req" in out[-2]
    assert "gpu-profile: 2 launches in" in captured.err
    doc = json.loads(out_json.read_text())
    assert doc == {"arch": "sm_90a", "launches": RECORDS}


def test_a_failed_driver_is_one_line(tmp_path, monkeypatch, capsys):
    import mla_kpool.gpu_profile as gpu_profile

    fake = tmp_path / "mojo"
    fake.write_text(
        "#!/bin/sh\necho 'x.mojo:1:1: error: no such thing' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_profile, "mojo_command", lambda: str(fake))
    assert main(["gpu-profile"]) == 1
    err = capsys.readouterr().err
    assert (
        "gpu-profile: the driver failed: x.mojo:1:1: error: no such thing"
        in err
    )


#: The writers' launches the driver prints: the op's registered name and
#: the workload's in bench.bounds (the step's scan and rows share one).
WRITER_LAUNCHES = [
    (op, f"{name}-b{batch}")
    for batch in (64, 4096)
    for op, name in (
        ("mo.mla.kpool.ring_close", "ring_close"),
        ("mo.mla.kpool.compress", "compress"),
        ("mo.mla.kpool.seed_tail", "seed_tail"),
        ("mo.mla.kpool.expand_topk", "expand_topk"),
    )
] + [("mla_kpool.step", "step-b4096")] * 2


def test_a_writer_launch_finds_its_roofline_bytes():
    from mla_kpool.gpu_profile import LAUNCHES

    assert LAUNCHES == 12 + len(WRITER_LAUNCHES)
    for op, workload in WRITER_LAUNCHES:
        line = _launch("kpool_ring_close_kernel")
        record = launch_record(
            line | {"op": op, "workload": workload, "window_rows": 0}
        )
        assert record["op"] == op and record["workload"] == workload
        assert record["global"]["bound_bytes"] == WORKLOADS[workload]["bytes"]
        assert record["window_rows"] == 0
