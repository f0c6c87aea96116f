"""The engines bench's single-flight measurement (bench/engine_flight.py) without engines: the
figures it draws from two engines' reports, the per-run ratios, the medians and the table, and
its refusal of bad arguments before any engine starts.  No timing assertions: the reports are
made up here."""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import engine_flight as ef  # noqa: E402


def report(t_done, cached, ttft, order=(0, 1, 2, 3), hits=0, tokens=1024):
    """An e2e.flight_engine report: 4 prompts of ``tokens`` tokens, lists in prompt order."""
    return {"outputs": [[1, 2]] * 4, "cached": list(cached), "ttft": list(ttft),
            "metrics": {"external_prefix_cache_hits": hits}, "prompt_tokens": 4 * tokens,
            "t_go": 100.0, "t_done": t_done, "order": list(order)}


def test_figures_of_one_configuration():
    # A computed prompts 0 and 2 and loaded 1 and 3; B, which sent them last first, the rest.
    a = report(108.0, [0, 992, 0, 992], [1.0, 5.0, 4.0, 7.5], hits=1984)
    b = report(107.5, [992, 0, 992, 0], [6.0, 3.0, 5.5, 1.5], order=(3, 2, 1, 0), hits=1984)
    f = ef.figures(a, b, 100.0, {"waits": 7, "waited_requests": 2, "gave_up": 0},
                   {"waits": 3, "waited_requests": 1, "gave_up": 1})
    assert f["wall_s"] == pytest.approx(8.0)
    assert (f["a_s"], f["b_s"]) == (pytest.approx(8.0), pytest.approx(7.5))
    assert (f["computed_a"], f["computed_b"], f["computed"]) == (2112, 2112, 4224)
    assert f["computed_x"] == pytest.approx(4224 / 4096)
    assert f["external_hits"] == [1984, 1984]
    # each engine's first request is the first it sent: A's prompt 0, B's prompt 3
    assert (f["ttft_a_first_s"], f["ttft_b_first_s"]) == (1.0, 1.5)
    # prompt 0 (A's first): B loaded it (992 cached), A computed it: 6.0 / 1.0
    assert f["ttft_loader_over_computer"] == pytest.approx(6.0)
    assert (f["waits"], f["waited_requests"], f["gave_up"]) == ([7, 3], [2, 1], [0, 1])


def test_loader_over_computer_is_none_when_both_computed_the_prompt():
    a = report(110.0, [0, 0, 0, 0], [1.0] * 4)
    b = report(110.0, [0, 0, 0, 0], [1.2] * 4)
    assert ef.figures(a, b, 100.0, {}, {})["ttft_loader_over_computer"] is None
    assert ef.figures(a, b, 100.0, {}, {})["computed_x"] == pytest.approx(2.0)


def test_figures_refuse_engines_given_different_prompts():
    a = report(110.0, [0] * 4, [1.0] * 4)
    b = report(110.0, [0] * 4, [1.0] * 4, tokens=512)
    with pytest.raises(ValueError, match=r"different prompts: 4096 and 2048 prompt tokens"):
        ef.figures(a, b, 100.0, {}, {})


def fig(wall, a_s, b_s, computed=4096):
    return {"wall_s": wall, "a_s": a_s, "b_s": b_s, "computed": computed,
            "computed_x": computed / 4096, "ttft_a_first_s": 1.0, "ttft_b_first_s": 2.0,
            "ttft_loader_over_computer": 2.0, "gave_up": [0, 0], "waited_requests": [1, 1],
            "equal_tokens": True}


def test_ratios_medians_and_the_table():
    runs = [{"together": fig(8.0, 8.0, 7.0), "nowait": fig(16.0, 16.0, 14.0, 8000),
             "none": fig(15.0, 15.0, 14.0, 8192)},
            {"together": fig(10.0, 9.0, 10.0), "nowait": fig(12.0, 12.0, 11.0, 8000),
             "none": fig(12.0, 11.0, 12.0, 8192)},
            # the third run: B was slower together than without waiting
            {"together": fig(9.0, 9.0, 9.0), "nowait": fig(9.9, 9.9, 8.1, 8000),
             "none": fig(18.0, 18.0, 18.0, 8192)}]
    r = ef.run_ratios(runs[0])
    assert r["nowait_over_together_wall"] == pytest.approx(2.0)
    assert r["nowait_over_together_b"] == pytest.approx(2.0)
    assert r["none_over_together_a"] == pytest.approx(15.0 / 8.0)
    s = ef.summarize(runs)
    assert s["ratios"]["nowait_over_together_wall"] == "1.2 [1.1-2]"
    assert s["ratios"]["none_over_together_wall"] == "1.88 [1.2-2]"
    assert s["together"]["wall_s"] == "9 [8-10]"
    assert s["nowait"]["computed"] == [8000, 8000, 8000]
    assert s["both_sooner_than_nowait"] == "2 of 3"
    md = "\n".join(ef.render("large (8 layers, hidden 1024)", s, {}))
    assert re.search(r"^\| single flight \(default peer_wait_s\) \| 9 \[8-10\] \|", md, re.M)
    assert re.search(r"^\| nowait / together \| 1\.2 \[1\.1-2\] \|", md, re.M)
    assert re.search(r"^\| no connector \| .* \| 8192, 8192, 8192 \(2 \[2-2\]\) \|", md, re.M)
    assert "in 2 of 3 runs" in md


def test_a_configuration_left_out_leaves_out_its_ratios():
    s = ef.summarize([{"together": fig(8.0, 8.0, 7.0), "none": fig(16.0, 16.0, 14.0)}])
    assert set(s["ratios"]) == {"none_over_together_wall", "none_over_together_a",
                                "none_over_together_b"}
    assert "nowait" not in s and s["both_sooner_than_nowait"] == "0 of 0"


def test_med_skips_missing_figures():
    assert ef.med([None, 2.0, 4.0, 3.0]) == "3 [2-4]"
    assert ef.med([None]) == "-"


@pytest.mark.parametrize("text,why", [
    ("0", r"two different CPUs"), ("1,1", r"two different CPUs"), ("0,x", r"two CPU numbers"),
    ("0,1,2", r"two different CPUs"), ("0,4096", r"may run only on CPUs")])
def test_bad_cores_are_refused(text, why):
    with pytest.raises(ValueError, match=why):
        ef.parse_cores(text)


@pytest.mark.parametrize("argv,why", [
    (["--cores", "3,3"], r"--cores must name two different CPUs"),
    (["--configs", "together,bogus"], r"--configs must name some of together,nowait,none"),
    (["--runs", "0"], r"--runs must be at least 1, got 0"),
    (["--batched-tokens", "0"], r"--batched-tokens must be at least 1")])
def test_bad_arguments_stop_before_any_engine_starts(argv, why, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        ef.main(argv + ["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert re.search(why, capsys.readouterr().err)
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_the_layout_is_one_core_each_and_the_same_otherwise():
    a, b = ef.thread_layout(0), ef.thread_layout(1)
    assert a["VLLM_CPU_OMP_THREADS_BIND"] == "0" and b["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert {k: v for k, v in a.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} == \
        {k: v for k, v in b.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} == \
        {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1"}


def test_the_header_names_the_command_as_run():
    import argparse
    a = argparse.Namespace(runs=3, prompts=4, tokens=2048, models="large", batched_tokens=512,
                           order="reversed", cores="0,1", configs="together,nowait",
                           name="flight-router")
    meta = {"commit": "abc1234", "cores": [0, 1], "cpus": 2, "load_before": [1.0, 1.0, 1.0],
            "load_after": [2.0, 2.0, 2.0]}
    text = ef.header(a, meta)[2]
    assert "--order reversed --cores 0,1 --configs together,nowait --name flight-router` on " \
        "abc1234" in text
    assert "B in the reverse order" in text and "load average [1.0, 1.0, 1.0] before" in text
    a.configs, a.name, a.order = ",".join(ef.CONFIGS), "flight", "same"
    text = ef.header(a, meta)[2]
    assert "--cores 0,1` on abc1234" in text and "(the same order)" in text
