"""The config layer: flags, YAML and sweep values typed and checked one way, `--print-config`, help texts."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass

import pytest
import yaml

from peftlab.cli.main import main
from peftlab.config import (REPORT_TO, SCHEDULERS, CordaOptions, FourierFTOptions, KasaOptions, MethodConfig,
                            TrainConfig, add_dataclass_flags, build_config, coerce, field_docs, save_config)
from peftlab.config_cli import field_types, normalise_keys
from peftlab.config_roles import choices_of, option_names
from peftlab.errors import PeftlabError
from peftlab.methods.table import METHOD_OPTIONS
from peftlab.resolve import build_run_config


def one_line(call, *args, **kwargs) -> str:
    with pytest.raises(PeftlabError) as err:
        call(*args, **kwargs)
    message = str(err.value)
    assert message and "\n" not in message, message
    return message


def test_print_config_prints_the_resolved_yaml_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-bert", "--rank", "4", "--lr-ratio", "2", "--targets", "q,k,v",
                 "--scheduler", "cosine", "--pad-to-max", "--output-dir", str(out), "--print-config"])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists() and not any(tmp_path.iterdir())
    expected = build_run_config(overrides=dict(model="tiny-bert", rank=4, lr_ratio=2.0, targets="q,k,v",
                                               scheduler="cosine", pad_to_max=True, output_dir=str(out)))
    assert yaml.safe_load(printed) == expected.to_dict()
    assert yaml.safe_load(printed)["lr"] == expected.optim.lr > 0  # resolved: the method's default rate filled in
    assert build_config(TrainConfig, overrides=dict(model="tiny-bert")).optim.lr is None  # the schema alone: not yet
    save_config(expected, tmp_path / "config.yaml")  # what the run would write, byte for byte
    assert (tmp_path / "config.yaml").read_text() == printed


def test_print_config_underscore_spelling_and_yaml(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny-bert\nlr-ratio: 4\nmethod: dora\n")
    assert main(["train", "--config", str(config), "--print_config", "--method", "kasa"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lr_ratio"] == 4.0 and printed["method"] == "kasa" and printed["model"] == "tiny-bert"


def test_print_config_still_refuses_bad_input(tmp_path, capsys):
    assert main(["train", "--rank", "eight", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--rank must be int, got 'eight'" in captured.err


def test_literal_choices_are_in_help_and_match_the_tables(capsys):
    hints = field_types(TrainConfig)
    assert choices_of(hints["scheduler"]) == tuple(SCHEDULERS)
    assert choices_of(hints["report_to"]) == REPORT_TO
    assert choices_of(hints["rank"]) is None
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--scheduler {linear,cosine,constant}" in text and "--save {best,last}" in text
    assert "--report-to {auto,tensorboard,wandb,mlflow,none}" in text
    assert "--lr-ratio LR_RATIO" in text and "--pad-to-max, --no-pad-to-max" in text  # flags as they were
    assert "lambda = eta_V / eta_QK" in text  # the docstring under the field is its help


def test_help_texts_are_the_field_docstrings_through_the_bases():
    @dataclass
    class Base:
        """Base part"""

        width: int = 3
        """How wide."""

    @dataclass
    class Child(Base):
        """Child part"""

        name: typing.Literal["a", "b"] = "a"
        """Which one,
        on two lines."""

    docs = field_docs(Child)
    assert docs == {"width": "How wide.", "name": "Which one, on two lines."}
    assert coerce(Child, "width", "7", "test") == 7
    # typed and checked by the declaration where the value enters (its one check), naming where it came from
    assert "unknown --name 'c' (test)" in one_line(coerce, Child, "name", "c", "test")
    assert choices_of(field_types(Child)["name"]) == ("a", "b")


@pytest.mark.parametrize("name, value, typed", [
    ("targets", "q,k,v", ("q", "k", "v")),  # peftlab's comma list
    ("targets", ["q", "v"], ("q", "v")),
    ("rank", "8", 8),
    ("rank", 8.0, 8),  # an int column with gaps, read back by pandas
    ("layers", 6, "6"),  # YAML reads `layers: 6` as a number
    ("eval_split", "~", "~"),  # text stays text (no YAML null inside a str option)
    ("lr", "1e-4", 1e-4),  # YAML 1.1 reads 1e-4 as text
    ("lr_ratio", 8, 8.0),
    ("overwrite", "yes", True),
    ("overwrite", False, False),
    ("max_steps", "null", None),
    ("scheduler", "cosine", "cosine"),
])
def test_values_are_typed_like_before(name, value, typed):
    assert coerce(TrainConfig, name, value, "test") == typed
    assert type(coerce(TrainConfig, name, value, "test")) is type(typed)


def test_non_finite_numbers_reach_the_config_check():
    # Python's spellings are read as numbers, then refused by the declaration's "finite"
    assert "--lr must be a finite number > 0, got nan (test)" in one_line(coerce, TrainConfig, "lr", "nan", "test")
    assert "--lr must be a finite number > 0, got nan" in one_line(build_config, TrainConfig,
                                                                   flag_values={"lr": "nan"})
    assert "--alpha must be a finite number > 0, got inf" in one_line(build_config, TrainConfig,
                                                                      overrides={"alpha": "inf"})


@pytest.mark.parametrize("name, value, phrase", [
    ("rank", "eight", "--rank must be int, got 'eight' (where)"),
    ("rank", 2.5, "--rank must be int, got 2.5"),
    ("rank", True, "--rank must be int, got True"),
    ("lr", "fast", "--lr must be float, got 'fast'"),
    ("overwrite", "maybe", "--overwrite must be bool"),
    ("targets", {"q": 1}, "--targets must be tuple"),
    ("scheduler", "cosin", "unknown --scheduler 'cosin' (did you mean 'cosine'?) (where)"),  # checked on entry
    ("rank", "0", "--rank must be a positive integer, got 0 (where)"),
])
def test_bad_values_are_one_line_naming_the_flag(name, value, phrase):
    assert phrase in one_line(coerce, TrainConfig, name, value, "where")


@pytest.mark.parametrize("name, value, phrase", [
    ("scheduler", "cosin", "unknown --scheduler 'cosin' (did you mean 'cosine'?); fix: use one of: constant, cosine"),
    ("mixed_precision", "fp8", "unknown --mixed-precision 'fp8'"),
    ("method", "LoRRA", "unknown method 'lorra' (did you mean 'lora'?) (--method)"),
])
def test_bad_choices_are_one_line_with_a_suggestion(name, value, phrase):
    assert phrase in one_line(build_config, TrainConfig, flag_values={name: value})


def test_flags_yaml_and_overrides_give_the_same_config(tmp_path):
    given = {"rank": "4", "lr": "1e-3", "targets": "q,k,v", "layers": "6-11", "max_steps": "5", "lr_ratio": "2",
             "scheduler": "constant", "overwrite": True}
    from_flags = build_config(TrainConfig, flag_values=given).to_dict()
    path = tmp_path / "c.yaml"
    path.write_text("rank: 4\nlr: 1e-3\ntargets: q,k,v\nlayers: 6-11\nmax-steps: 5\nlr_ratio: 2\n"
                    "scheduler: constant\noverwrite: true\n")
    from_yaml = build_config(TrainConfig, yaml_path=str(path)).to_dict()
    from_overrides = build_config(TrainConfig, overrides={**given, "rank": 4, "targets": ("q", "k", "v")}).to_dict()
    assert from_flags == from_yaml == from_overrides
    assert from_flags["layers"] == "6,7,8,9,10,11" and from_flags["lr"] == 1e-3
    # precedence: defaults < YAML < flags
    assert build_config(TrainConfig, yaml_path=str(path), flag_values={"rank": "2"}).rank == 2


def test_every_option_has_help_text():
    docs = field_docs(TrainConfig)
    assert [name for name in option_names(TrainConfig) if not docs.get(name)] == []


# --------------------------------------------------------------------------- nested option groups (cfg.kasa.beta)


def test_method_options_nest_like_peft_and_keep_their_flat_flags():
    cfg = build_config(TrainConfig, flag_values={"method": "kasa", "kasa_beta": "0.01", "kasa_mode": "REFERENCE",
                                                 "fourierft_n_frequency": "64"})
    assert isinstance(cfg.kasa, KasaOptions) and (cfg.kasa.beta, cfg.kasa.mode) == (0.01, "reference")
    assert cfg.fourierft == FourierFTOptions(n_frequency=64) and cfg.corda == CordaOptions()
    assert MethodConfig(method="kasa", kasa={"beta": 0.5}).kasa == KasaOptions(beta=0.5)  # a mapping is built
    with pytest.raises(dataclasses.FrozenInstanceError):  # shared by dataclasses.replace copies: never mutated
        cfg.kasa.beta = 1.0
    # the flag's help is the docstring under the nested field; errors name the flat flag
    assert field_docs(TrainConfig)["kasa_beta"] == "KaSA: weight of ||Delta_sigma||^2 in the loss."
    assert "--kasa-beta must be float, got 'x'" in one_line(coerce, TrainConfig, "kasa_beta", "x", "w")
    assert "--kasa-beta must be a finite number >= 0" in one_line(build_config, TrainConfig, overrides={"kasa_beta": -1})
    assert "did you mean 'kasa_beta'" in one_line(normalise_keys, TrainConfig, {"kasa_bta": 1}, "w")
    assert not {"kasa", "corda", "vera", "fourierft"} & set(option_names(TrainConfig))  # groups are not keys
    assert METHOD_OPTIONS <= set(option_names(TrainConfig))  # Method.options name real flat options


def test_flat_and_nested_yaml_give_the_same_config(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("method: kasa\nkasa_beta: 0.01\nkasa-mode: reference\nkasa_truncate_rank: 4\n"
                    "corda_samples: 8\nvera_d_initial: 0.5\n")
    nested.write_text("method: kasa\nkasa:\n  beta: 0.01\n  mode: reference\n  truncate-rank: 4\n"
                      "corda: {samples: 8}\nvera: {d_initial: 0.5}\n")
    from_flat_yaml = build_config(TrainConfig, yaml_path=str(flat))
    from_nested_yaml = build_config(TrainConfig, yaml_path=str(nested))
    assert from_flat_yaml == from_nested_yaml
    assert from_nested_yaml.kasa == KasaOptions(beta=0.01, mode="reference", truncate_rank=4)
    assert from_flat_yaml.to_dict() == from_nested_yaml.to_dict()
    assert from_nested_yaml.to_dict()["kasa_truncate_rank"] == 4 and "kasa" not in from_nested_yaml.to_dict()
    # flags override a nested YAML option like a flat one
    assert build_config(TrainConfig, yaml_path=str(nested), flag_values={"kasa_beta": "0.5"}).kasa.beta == 0.5
    # an option set in a nested group is explicit: a method that ignores it refuses it
    lora = tmp_path / "lora.yaml"
    lora.write_text("method: lora\nkasa: {beta: 0.01}\n")
    assert "--kasa-beta is set, but method 'lora' does not use it" in one_line(
        build_run_config, yaml_path=str(lora), check_explicit=True)


@pytest.mark.parametrize("text, phrase", [
    ("kasa_beta: 0.01\nkasa: {beta: 0.02}\n", "config key 'kasa_beta' is given twice, as 'kasa_beta' and as "
                                               "'kasa: {beta: ...}'"),
    ("kasa: {beta: 0.02}\nkasa-beta: 0.01\n", "config key 'kasa_beta' is given twice"),
    ("lr-ratio: 2\nlr_ratio: 3\n", "config key 'lr_ratio' is given twice"),
    ("kasa: {bta: 0.01}\n", "unknown config key 'kasa.bta' (did you mean 'beta'?)"),
    ("kasa: 0.01\n", "config key 'kasa' must be a mapping of its options"),
    ("kasa: {beta: fast}\n", "--kasa-beta must be float, got 'fast'"),
])
def test_bad_nested_yaml_is_one_line(tmp_path, text, phrase):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    message = one_line(build_config, TrainConfig, yaml_path=str(path))
    assert phrase in message and str(path) in message


def test_to_dict_stays_flat_so_run_keys_and_config_yaml_do_not_change(tmp_path):
    from peftlab.lab.store import config_key

    # Recorded before the options were nested (pooling pinned: its default changed separately, and it is hashed).
    default = build_run_config(overrides={"pooling": "auto"})
    assert config_key(default.to_dict()) == "98a58c7dab8afae73e49bf3f1c629d350894339dc83a27d8dae5ecb0112ebee7"
    kasa = build_run_config(overrides={"pooling": "auto", "method": "kasa", "kasa_beta": 0.01,
                                       "kasa_mode": "reference", "kasa_truncate_rank": 4})
    assert config_key(kasa.to_dict()) == "32035bae22f885cf64f93b8b5ece736235bd3a0929baf1e0fab97006a0e5ea89"
    keys = list(default.to_dict())
    assert keys[:5] == ["lr", "lr_ratio", "head_lr", "weight_decay", "method"]  # cfg.optim's lead, as before
    assert keys[keys.index("dropout") + 1: keys.index("task")] == [
        "kasa_beta", "kasa_gamma", "kasa_reduction", "kasa_truncate_rank", "kasa_mode", "corda_mode",
        "corda_samples", "vera_d_initial", "fourierft_n_frequency", "fourierft_scaling"]  # same order as before
    # an old flat config.yaml (peftlab evaluate, --resume) and result.json's config read back to the same config
    save_config(kasa, tmp_path / "config.yaml")
    assert "kasa_mode: reference\n" in (tmp_path / "config.yaml").read_text()
    assert build_config(TrainConfig, yaml_path=str(tmp_path / "config.yaml")) == kasa
    assert TrainConfig.from_dict(kasa.to_dict()) == kasa


def test_the_config_layer_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, peftlab.config_cli; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_optimizer_part_is_composed_and_spelled_flat(tmp_path):
    from peftlab.config import OptimConfig

    cfg = build_config(TrainConfig, flag_values={"lr": "1e-3", "lr_ratio": "4", "weight_decay": "0.1"})
    assert cfg.optim == OptimConfig(lr=1e-3, lr_ratio=4.0, weight_decay=0.1)
    assert not hasattr(cfg, "lr") and not hasattr(cfg, "lr_ratio")  # one owner: cfg.optim (no flat proxy)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg and "optim" not in option_names(TrainConfig)
    assert [f.name for f in dataclasses.fields(OptimConfig)] == ["lr", "lr_ratio", "head_lr", "weight_decay"]
    assert "lr" not in {f.name for f in dataclasses.fields(TrainConfig)}  # declared once, in OptimConfig
    assert "unknown config key 'optim'" in one_line(normalise_keys, TrainConfig, {"optim": {"lr": 1}}, "w")


def test_help_groups_the_flags_by_where_they_apply(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    titles = [TrainConfig.SECTIONS[key] for key in ("run", "optim", "eval", "data", "method", "kasa", "labelled",
                                                      "judge")]
    at = [text.index("\n" + title + ":\n") for title in titles]
    assert at == sorted(at), "sections out of their declared order"

    def section_of(flag: str) -> str:  # the title of the last section that starts before the flag
        where = text.index(f"\n  {flag} ")
        return max((text.index("\n" + t + ":\n"), t) for t in TrainConfig.SECTIONS.values()
                   if text.index("\n" + t + ":\n") < where)[1]

    sections = TrainConfig.SECTIONS
    assert section_of("--task") == sections["run"] and section_of("--lr-ratio") == sections["optim"]
    assert section_of("--epochs") == sections["optim"] and section_of("--eval-seed") == sections["eval"]
    assert section_of("--kasa-beta") == "KaSA (--method kasa only)" and section_of("--rank") == sections["method"]
    assert section_of("--judge-url") == "MT-Bench judge (--task mt-bench only)"
    assert section_of("--label-field") == "Your own labelled data (--task classify|regress only)"


def test_another_subcommand_takes_chosen_train_flags_from_their_declarations(capsys):
    """study / bench: the same flag names, checks and help as `peftlab train`, their own defaults, nothing else."""
    parser = argparse.ArgumentParser(prog="peftlab other")
    add_dataclass_flags(parser, TrainConfig, only=("lr", "rank", "targets", "pad_to_max", "kasa_beta", "task"),
                        defaults={"rank": 4})
    args = parser.parse_args(["--lr", "1e-3", "--targets", "v,q", "--task", "SST2"])
    assert (args.lr, args.rank, args.targets, args.pad_to_max, args.kasa_beta, args.task) == (
        1e-3, 4, ("q", "v"), False, 1e-4, "sst2")  # typed and normalised as the config types them
    for argv, phrase in ((["--rank", "0"], "argument --rank: --rank must be a positive integer, got 0"),
                         (["--lr", "fast"], "argument --lr: --lr must be float, got 'fast'"),
                         (["--task", "rtee"], "unknown task 'rtee' (did you mean 'rte'?)")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert phrase in capsys.readouterr().err
    text = " ".join(parser.format_help().split())
    assert field_docs(TrainConfig)["lr_ratio"] not in text and "--epochs" not in text  # only the chosen ones
    assert field_docs(TrainConfig)["kasa_beta"] in text and "(default: 4)" in text  # train's help, own default
    assert TrainConfig.SECTIONS["optim"] in text and "KaSA (--method kasa only)" in text  # train's sections
    with pytest.raises(TypeError, match="no option nope"):
        add_dataclass_flags(argparse.ArgumentParser(), TrainConfig, only=("nope",))
