"""The registry of policies: one constructor, one knob name, bounds refused in one line, defaults per path, and the
calibration file that `echospec bench --sweep` writes and `generate`, `synthesize` and vLLM read."""

import json
import warnings

import numpy as np
import pytest

from echospec.decoder import Filtered, GroupRejection, Tolerance
from echospec.decoder.registry import (RULES, default, load_relaxed_settings, make_policy, options,
                                       relaxed_settings_record)


def test_one_constructor_builds_every_policy_at_its_paths_defaults():
    assert {type(make_policy(name)).__name__ for name in RULES} == {r.class_name for r in RULES.values()}
    assert make_policy("filtered").tau == Filtered().tau == default("filtered", "tree")
    assert make_policy("tolerance", path="chain").beta == default("tolerance", "chain")
    assert make_policy("tolerance", beta=0.2, seed=0).beta == 0.2


def test_bad_names_options_and_values_are_one_line_errors():
    for bad, message in [(("typical",), {}), (("filtered",), {"beta": 0.3}), (("tolerance",), {"beta": 1.5}),
                         (("filtered",), {"tau": 0}), (("tolerance",), {"path": "graph"})]:
        with pytest.raises(ValueError) as raised:
            make_policy(*bad, **message)
        assert "\n" not in str(raised.value)


def test_the_old_spelling_of_threshold_still_works_and_says_so():
    with pytest.warns(DeprecationWarning, match="'similarity' is now 'threshold'"):
        assert options("pcg", {"similarity": 0.3}) == {"threshold": 0.3}
    assert isinstance(make_policy("pcg", threshold=0.3), GroupRejection)


def _record(**change):
    return relaxed_settings_record({"tolerance": {"beta": 0.2}}, model="tools/sample/model", store="s",
                                   prompts="p") | change


def test_a_calibration_file_is_taken_as_it_is_and_names_its_model(tmp_path):
    path = tmp_path / "relaxed_settings.json"
    path.write_text(json.dumps(_record()))
    settings = load_relaxed_settings(path, model="tools/sample/model")
    assert isinstance(make_policy("tolerance", **settings["tolerance"]), Tolerance)
    assert settings == {"tolerance": {"beta": 0.2}}
    with pytest.warns(UserWarning, match=r"measured on model 'tools/sample/model', not 'Llasa-1B'"):
        load_relaxed_settings(path, model="Llasa-1B")
    with pytest.warns(UserWarning, match="tree path, used on the chain path"):
        load_relaxed_settings(path, path="chain")


def test_a_malformed_or_out_of_bounds_calibration_file_is_refused_in_one_line(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for bad in (broken, tmp_path / "missing.json", {"policies": {}}, _record(policies={"tolerance": {"beta": 3}}),
                _record(policies={"tolerance": 0.2}), _record(policies={"typical": {}})):
        with pytest.raises(ValueError) as raised, warnings.catch_warnings():
            load_relaxed_settings(bad)
        assert "\n" not in str(raised.value)


def test_tau_below_one_is_a_share_of_the_probability_on_any_vocabulary():
    import torch

    from echospec.decoder.policies import filtered_choice
    from echospec.decoder.sampling import NodeState, Sampler
    from echospec.decoder.verified import Rows, VerifiedTree

    for vocabulary in (512, 65_536):
        scores = torch.full((vocabulary,), -30.0)
        scores[:3] = torch.log(torch.tensor([0.5, 0.3, 0.15]))  # the rest hold almost nothing
        logits = scores.repeat(4, 1)
        tree = VerifiedTree(logits, [0, 1, 2], np.array([-1, -1, -1]), NodeState([5], 0, (vocabulary - 1,)))
        ranks, shares, own = Rows(tree, torch.Generator(), Sampler()).child_standing
        assert ranks == [0, 1, 2] and shares == pytest.approx([0.0, 0.5 / 0.95, 0.8 / 0.95], abs=1e-4)
        passes = [filtered_choice(7, [d], [shares[d]], [own[d]], [], (), 0.7, 10, 0.1)[0] == 0 for d in (0, 1, 2)]
        assert passes == [True, True, False]  # above the third lie 0.84 of the mass, past the share 0.7
