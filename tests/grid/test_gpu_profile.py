"""``gpu-profile`` without running its driver: options, table, verdict.

The counts themselves are the emulated profile's, checked on kernels with
known answers in tests/mojo/test_profile.mojo; here the command's reading
of the driver's lines.
"""

from __future__ import annotations

import json

import pytest

from mla_kpool.__main__ import main
from mla_kpool.gpu_profile import format_table, parse_lines, verdict


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
    } | more


def _launch(kernel: str, *sites: dict) -> dict:
    requests = sum(s["requests"] for s in sites)
    wavefronts = sum(s["wavefronts"] for s in sites)
    return {
        "op": "index_top_k",
        "workload": "glm5next-decode-16x32k",
        "arch": "sm_90a",
        "window_rows": 16,
        "profile": {
            "kernel": kernel,
            "grid": 512,
            "blocks": 16,
            "barriers_per_block": 1,
            "shared": {
                "requests": requests,
                "wavefronts": wavefronts,
                "sites": list(sites),
            },
        },
    }


CONFLICTED = _launch(
    "mla_kpool_index_score_kernel",
    _site("kernels/index/gpu/index_gpu_score.mojo:332:24", 32, 2048),
    _site("kernels/index/gpu/index_gpu_score.mojo:217:20", 1, 6144),
)
CLEAN = _launch(
    "mla_kpool_index_select_kernel",
    _site("kernels/index/gpu/index_pick.mojo:218:26", 2, 100),
    _site(
        "kernels/index/gpu/index_pick.mojo:358:29",
        1,
        10,
        access="atomic",
        max_lanes_per_address=18,
    ),
)


def test_the_table_names_the_worst_site_and_its_ways():
    header, conflicted, clean, note = format_table([CONFLICTED, CLEAN])
    assert header.split()[:8] == [
        "workload",
        "kernel",
        "blocks",
        "bar",
        "requests",
        "wf/req",
        "ways",
        "atomic",
    ]
    # 2,048 requests at 32 wavefronts and 6,144 at 1: 71,680 / 8,192.
    assert conflicted.split() == [
        "glm5next-decode-16x32k",
        "score_kernel",
        "16/512",
        "1",
        "8,192",
        "8.75",
        "32",
        "-",
        "kernels/index/gpu/index_gpu_score.mojo:332:24",
    ]
    # 100 requests at 2 wavefronts and 10 at 1: 210 / 110.
    assert clean.split()[5:8] == ["1.91", "2", "18"]
    assert note == (
        "  32-way: kernels/index/gpu/index_gpu_score.mojo:332:24 (store, 4"
        " bytes a lane; 2,048 requests, 65,536 wavefronts for 2,048) in"
        " glm5next-decode-16x32k mla_kpool_index_score_kernel"
    )


def test_the_verdict_names_the_kernels_past_2_way():
    assert verdict([CLEAN]) == (
        "verdict: 1 launches, every shared site at most 2-way"
    )
    assert verdict([CONFLICTED, CLEAN, CONFLICTED]) == (
        "verdict: 1 kernels with a shared site past 2-way:"
        " mla_kpool_index_score_kernel"
    )


def test_the_driver_lines_are_json_objects():
    text = json.dumps(CLEAN) + "\n\n" + json.dumps(CONFLICTED) + "\n"
    assert parse_lines(text) == [CLEAN, CONFLICTED]


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
    assert out[1].startswith("glm5next-decode-16x32k  score_kernel")
    assert out[-1] == verdict([CONFLICTED, CLEAN])
    assert "gpu-profile: 2 launches in" in captured.err
    doc = json.loads(out_json.read_text())
    assert doc == {"arch": "sm_90a", "launches": [CONFLICTED, CLEAN]}


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
