"""tools/method_costs.py: a --micro the shipped presets cannot run is refused in one line before
any model is built."""
import pytest

from tools import method_costs


def no_model(*args, **kwargs):
    raise AssertionError("a model was built for a --micro the presets cannot run")


@pytest.mark.parametrize("micro", [2, 6])
def test_a_micro_batch_mixedae_cannot_group_is_refused_in_one_line(micro, monkeypatch, capsys):
    """MixedAE mixes groups of g = 1/mix_ratio = 4 images (its ViT-B preset): --micro 2 ended in a
    traceback from inside the mixing."""
    monkeypatch.setattr(method_costs, "step_flops", no_model)
    with pytest.raises(SystemExit) as exited:
        method_costs.main(["--micro", str(micro)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--micro {micro}" in err and "groups of g = 1/mixedae.mix_ratio = 4 images" in err
    assert f"give a multiple of 4 (e.g. --micro {micro + 4 - micro % 4})" in err


def test_the_group_size_is_read_from_the_preset(monkeypatch, capsys):
    """A preset that mixes pairs (mix_ratio 0.5) takes any even --micro and refuses an odd one."""
    monkeypatch.setitem(method_costs.METHODS, "mixedae", [*method_costs.METHODS["mixedae"],
                                                          "--mixedae.mix_ratio", "0.5"])
    assert method_costs.micro_batch_problem(2, method_costs.method_configs()) is None
    assert "give a multiple of 2 (e.g. --micro 4)" in method_costs.micro_batch_problem(3, method_costs.method_configs())
