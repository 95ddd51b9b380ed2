"""Config: the demo by default (its preset over defaults made for real models), YAML +
overrides, each key's source, one-line errors naming the key."""

import re

import pytest
import torch

from r1fit.config import (
    Config,
    ConfigError,
    config_reference_markdown,
    iter_fields,
    load_config,
    preset_values,
    resolve_config,
)
from r1fit.config.load import _read_yaml

#: the demo's values (before defaults were made for real models; its preset keeps them)
DEMO = {"train.learning_rate": 3e-3, "sft.learning_rate": 1e-2, "algo.max_new_tokens": 24,
        "algo.beta": 0.05, "sft.format_warmup_steps": 60, "sft.think": "I look at the image.",
        "data.max_pixels": 112 * 112}


def test_no_arguments_is_the_demo():
    cfg = load_config()
    assert cfg.model.path == "builtin:tiny"
    assert cfg.data.train == "builtin:shapes"
    assert cfg.model.lora.r == 0
    # the checkpoint's dtype, float32 for builtin:tiny (tests/models/test_dtype.py loads it)
    assert cfg.model.dtype == "auto"
    assert cfg.applied_preset() == "demo"
    assert {key: cfg.value(key) for key in DEMO} == DEMO
    assert cfg.value("model.lora.r") == cfg.model.lora.r == 0


def test_defaults_are_made_for_real_models():
    cfg = load_config(None, ["model.path=Qwen/Qwen2.5-VL-3B-Instruct"])
    assert cfg.applied_preset() is None
    assert cfg.train.learning_rate == 1e-6 and cfg.sft.learning_rate == 2e-5
    assert cfg.algo.max_new_tokens == 512 and cfg.sft.format_warmup_steps == 0
    assert cfg.sft.think is None  # a user's answers are not rewritten
    # every value of the demo preset differs from its default: the preset is what keeps the demo
    defaults = Config()
    assert all(defaults.value(key) != demo for key, demo in DEMO.items())


def test_demo_preset_file_holds_exactly_the_demo_values():
    flat = {f"{section}.{key}": v for section, keys in preset_values("demo").items()
            for key, v in keys.items()}
    assert flat == DEMO


@pytest.mark.parametrize("overrides, preset", [
    ([], "demo"),                                                  # builtin:tiny, preset=auto
    (["model.path=builtin:small-realvocab"], "demo"),
    (["model.path=/models/my-qwen"], None),
    (["preset=none"], None),                                       # builtin, asked for none
    (["model.path=/models/tiny-copy", "preset=demo"], "demo"),     # a folder, asked for demo
])
def test_which_preset_applies(overrides, preset):
    cfg = load_config(None, overrides)
    assert cfg.applied_preset() == preset
    assert (cfg.train.learning_rate == 3e-3) == (preset == "demo")


def test_layers_in_order_and_each_key_names_its_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  max_new_tokens: 40\n  beta: 0.1\ntrain:\n  learning_rate: 1.0e-3\n")
    cfg, sources = resolve_config(path, ["algo.beta=0.2", "rewards.format=1.0"])
    assert cfg.algo.max_new_tokens == 40 and cfg.algo.beta == 0.2  # file over preset, override over file
    assert cfg.sft.learning_rate == 1e-2 and cfg.train.learning_rate == 1e-3
    assert sources["algo.max_new_tokens"] == f"file {path}"
    assert sources["algo.beta"] == "override"
    assert sources["rewards"] == "override"
    assert sources["sft.learning_rate"] == "preset demo"
    assert sources["algo.num_generations"] == "default"
    # one source per leaf key of the tree, no more
    assert set(sources) == {key for key, _, _ in iter_fields()}
    # the preset follows the final model.path: a file naming a real model gets no demo values
    path.write_text("model:\n  path: /models/my-qwen\n")
    cfg, sources = resolve_config(path)
    assert cfg.train.learning_rate == 1e-6 and "preset demo" not in sources.values()


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  num_generations: 4\n  beta: 0.04\nmodel:\n  lora:\n    r: 8\n"
                    "rewards:\n  format: 1.0\n")
    cfg = load_config(path, ["algo.num_generations=16", "data.eval=null", "memory.micro_batch=2",
                             "rewards.mypkg.mod:fn=0.5"])
    assert cfg.algo.num_generations == 16
    assert cfg.algo.beta == 0.04
    assert cfg.model.lora.r == 8
    assert cfg.data.eval is None
    assert cfg.memory.micro_batch == 2
    # a YAML rewards mapping replaces the default one; overrides add to it
    assert cfg.rewards == {"format": 1.0, "mypkg.mod:fn": 0.5}


@pytest.mark.parametrize("override, value", [
    # a string key takes the override's text as typed, where YAML would change or refuse it
    ("data.system_prompt=Think first # then answer", "Think first # then answer"),
    ("data.system_prompt=Answer: briefly", "Answer: briefly"),
    ("data.system_prompt=yes", "yes"),
    ("report.run_name=1.10", "1.10"),
    ("report.run_name=007", "007"),
    ("train.output_dir=2024-05-01", "2024-05-01"),
    ("report.run_name=1:30", "1:30"),
    ("report.run_name=  spaced  ", "spaced"),
    # quoted: YAML's string (the empty one too); null where the key takes it
    ('sft.think=""', ""),
    ("sft.think='a # b'", "a # b"),
    ("sft.think=null", None),
    ("sft.think=", ""),
])
def test_a_string_override_is_its_text(override, value):
    key, _ = override.split("=", 1)
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [override]), section), name) == value


def test_other_overrides_are_read_as_yaml():
    cfg = load_config(None, ["data.train=[a.jsonl, b.jsonl]", "data.reward_method=mcq",
                             "algo.beta=1e-3", "memory.micro_batch=auto", "memory.generation_batch=4",
                             "report.to=[tensorboard]", "train.deterministic=yes",
                             "rewards={accuracy: 2}", "data.eval=null", "report.run_name=r"])
    assert cfg.data.train == ("a.jsonl", "b.jsonl") and cfg.data.reward_method == "mcq"
    assert cfg.algo.beta == 0.001 and cfg.memory.micro_batch == "auto"
    assert cfg.memory.generation_batch == 4 and cfg.report.to == ("tensorboard",)
    assert cfg.train.deterministic is True and cfg.rewards == {"accuracy": 2.0}
    assert cfg.data.eval is None
    assert type(cfg.report.run_name) is str  # no override object is kept in a config


@pytest.mark.parametrize("override, message", [
    ("algo.num_generation=8", "unknown key 'algo.num_generation'; allowed here: num_generations"),
    ("algo.num_generations=1", "algo.num_generations: got 1, expected a number >= 2"),
    ("algo.loss_aggregation=sum", "algo.loss_aggregation: got 'sum', expected one of 'token_mean'"),
    ("train.seed=abc", "train.seed: got 'abc', expected an integer"),
    ("memory.gradient_checkpointing=maybe", "memory.gradient_checkpointing: got 'maybe', expected true or false"),
    ("model.lora=3", "model.lora: got 3, expected a mapping"),
    ("algo.beta=-0.1", "algo.beta: got -0.1, expected a number >= 0"),
    ("data.max_pixels=100", "data.max_pixels: got 100, expected a number >= 784"),
    ("algo.top_p=1.5", "algo.top_p: got 1.5, expected a number <= 1"),
    ("train.learning_rate=nan", "train.learning_rate: got nan, expected a finite number"),
    ("rewards.accuracy=abc", "rewards.accuracy: got 'abc', expected a number"),
    ("data.shapes.kinds=size", "data.shapes.kinds: got ['size']"),
    ("nonsense", "override 'nonsense' is not key=value"),
    ("algo.advantage_estimator=ppo", "algo.advantage_estimator: got 'ppo', expected one of 'grpo', 'dr_grpo', "
                                     "'rloo', 'reinforce_pp', 'reinforce_pp_baseline'"),
    ("algo.importance_sampling_level=seq", "algo.importance_sampling_level: got 'seq', expected one of 'token'"),
    ("algo.gspo_epsilon=0", "algo.gspo_epsilon: got 0.0, expected a number > 0"),
    ("algo.gspo_epsilon=1.5", "algo.gspo_epsilon: got 1.5, expected a number < 1"),
    ("algo.epsilon=1", "algo.epsilon: got 1.0, expected a number < 1"),
    ("algo.overlong_buffer=-1", "algo.overlong_buffer: got -1, expected a number >= 0"),
    ("algo.overlong_buffer=25", "algo.overlong_buffer (25) must be <= algo.max_new_tokens (24)"),
    ("algo.overlong_penalty=-1", "algo.overlong_penalty: got -1.0, expected a number >= 0"),
    ("algo.entropy_coef=-0.01", "algo.entropy_coef: got -0.01, expected a number >= 0"),
    ("algo.tis_cap=-1", "algo.tis_cap: got -1.0, expected a number >= 0"),
    ("algo.tis_cap=0.5", "algo.tis_cap: got 0.5, expected 0, null (off) or a number >= 1"),
    ("algo.mask_truncated=sometimes", "algo.mask_truncated: got 'sometimes', expected true or false"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["algo.advantage_estimator=rloo", "algo.scale_rewards=false"],
     "algo.scale_rewards=false (Dr. GRPO) contradicts algo.advantage_estimator=rloo"),
    (["algo.kl_in_reward=true", "algo.beta=0"], "algo.kl_in_reward=true subtracts algo.beta x KL from the "
                                                "reward, but algo.beta is 0"),
])
def test_contradicting_algorithm_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_algorithm_choices():
    assert load_config().algo.estimator() == "grpo"
    assert load_config(None, ["algo.scale_rewards=false"]).algo.estimator() == "dr_grpo"
    assert load_config(None, ["algo.advantage_estimator=reinforce_pp"]).algo.estimator() == "reinforce_pp"
    assert load_config().algo.clip_range() == (0.2, 0.28)
    # a sequence-level ratio is clipped with GSPO's own ranges, not epsilon/epsilon_high
    gspo = load_config(None, ["algo.importance_sampling_level=sequence"]).algo
    assert gspo.clip_range() == (3e-4, 4e-4)
    assert load_config(None, ["algo.importance_sampling_level=sequence_token",
                              "algo.gspo_epsilon_high=null"]).algo.clip_range() == (3e-4, 3e-4)
    for off in ("0", "null"):
        assert not load_config(None, [f"algo.tis_cap={off}"]).algo.tis_cap
    # the LM head's gradient in its forward: on by default, off where the loss couples tokens
    assert load_config().fuses_loss()
    assert not load_config(None, ["memory.fused_loss=false"]).fuses_loss()
    assert load_config(None, ["memory.fused_loss=false"]).fuses_loss(sft=True) is False
    # memory.logits_chunk=auto: small where the head makes its gradient in forward (no
    # recompute), larger where it recomputes its chunks; a number is taken as it is
    assert load_config().head_chunk() == load_config().head_chunk(sft=True) == 256
    assert load_config(None, ["memory.fused_loss=false"]).head_chunk() == 1024
    gspo = load_config(None, ["algo.importance_sampling_level=sequence"])
    assert gspo.head_chunk() == 1024 and gspo.head_chunk(sft=True) == 256  # SFT still fuses
    assert load_config(None, ["memory.logits_chunk=512"]).head_chunk() == 512
    for coupled in ("algo.importance_sampling_level=sequence",
                    "algo.importance_sampling_level=sequence_token", "algo.cov_restriction=kl_cov"):
        assert not load_config(None, [coupled]).fuses_loss()


def test_a_budget_without_its_unit_is_refused():
    """A number alone is bytes: memory.budget=12 would be 12 bytes, a unit forgotten; a byte
    count as large as a device's (the GPU check writes them) is taken."""
    with pytest.raises(ConfigError, match="^memory.budget: 12 is 12 bytes; give a unit, e.g. "
                       "12GiB$"):
        load_config(None, ["memory.budget=12"])
    assert load_config(None, ["memory.budget=10737418240"]).memory.budget == "10737418240"
    assert load_config(None, ["memory.budget=12GiB"]).memory.budget == "12GiB"


def test_min_pixels_above_max(tmp_path):
    with pytest.raises(ConfigError, match="data.min_pixels .* must be <= data.max_pixels"):
        load_config(None, ["data.min_pixels=5000", "data.max_pixels=4000"])


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algo:\n  beta: [0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder; give a YAML file"):
        load_config(tmp_path)


def test_a_key_given_twice_in_a_file_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    # the second algo section would drop the first's num_generations without a word
    path.write_text("algo:\n  num_generations: 4\nmodel:\n  dtype: float32\nalgo:\n  beta: 0.2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:5: not valid YAML (key 'algo' given twice (lines 1 and "
                               "5))")
    path.write_text("algo:\n  beta: 0.1\n  beta: 0.2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml:3: .*key 'beta' given twice \(lines 2 and 3\)"):
        load_config(path)
    # a merge key repeats an anchor's keys on purpose: the key written out wins
    path.write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")
    assert _read_yaml(path) == {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2}}


def test_a_section_whose_keys_are_all_commented_out_sets_nothing(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("algo:\n  # beta: 0.1\nmodel:\n  lora:\n")
    cfg, sources = resolve_config(path)
    assert cfg == load_config(None)
    assert sources["algo.beta"] == "preset demo" and sources["model.lora.r"] == "default"
    with pytest.raises(ConfigError, match=r"model.lora: got None, expected a mapping"):
        load_config(None, ["model.lora=null"])  # an override of a whole section is no comment


def test_every_field_has_help():
    for key, _, help_text in iter_fields():
        assert help_text.strip(), f"{key} has no help text"
    table = config_reference_markdown()
    for key in ("train.output_dir", "train.max_steps", "train.seed", "train.prompts_per_step",
                "algo.num_generations", "algo.num_iterations", "algo.beta", "algo.max_new_tokens",
                "memory.micro_batch", "memory.gradient_checkpointing", "model.path", "model.lora.r",
                "data.train", "data.eval", "data.max_pixels", "data.min_pixels", "checkpoint.every"):
        assert f"`{key}`" in table


def test_fingerprint_changes_with_values():
    assert Config().fingerprint() == Config().fingerprint()
    assert load_config(None, ["train.seed=1"]).fingerprint() != Config().fingerprint()


def test_tools_are_off_by_default_with_their_budgets():
    cfg = Config()
    assert cfg.tools == ()
    assert (cfg.rollout.max_turns, cfg.rollout.max_tool_calls, cfg.rollout.max_trajectory_tokens,
            cfg.rollout.tool_timeout, cfg.data.max_images) == (4, 3, None, 10.0, 1)
    assert load_config(None, ["rollout.max_turns=6", "rollout.tool_timeout=2.5",
                              "rollout.max_trajectory_tokens=24"]).rollout.tool_timeout == 2.5
    assert load_config(None, ["tools=crop,mypkg.tools:rotate", "data.max_images=2"]).tools == \
        ("crop", "mypkg.tools:rotate")


@pytest.mark.parametrize("overrides, message", [
    # what multi-turn rollouts do not run with yet
    (["tools=[crop]", "data.max_images=2", "algo.overlong_buffer=4"],
     "algo.overlong_buffer: DAPO's overlong shaping"),
    (["tools=[crop,mypkg:f]"], "data.max_images=1: tools ['crop'] return images"),
    (["tools=[crop, crop]"], "tools: ['crop'] named more than once"),
    (["report.to=[mlflow,tensorboard,mlflow]"], "report.to: ['mlflow'] named more than once"),
    (["tools=[' crop']"], "tools: got [' crop'], expected built-in tool names"),
    (["tools=[zoom]", "rollout.max_turns=1"], "rollout.max_turns: got 1, expected >= 2 with tools"),
    (["tools=[zoom]", "rollout.max_tool_calls=0"], "rollout.max_tool_calls: got 0 with tools"),
    (["rollout.max_turns=0"], "rollout.max_turns: got 0, expected a number >= 1"),
    (["rollout.max_tool_calls=-1"], "rollout.max_tool_calls: got -1, expected a number >= 0"),
    (["rollout.tool_timeout=0"], "rollout.tool_timeout: got 0.0, expected a number > 0"),
    (["rollout.max_trajectory_tokens=0"], "rollout.max_trajectory_tokens: got 0"),
    (["rollout.max_trajectory_tokens=23"],  # the demo's algo.max_new_tokens is 24
     "rollout.max_trajectory_tokens (23) must be >= algo.max_new_tokens (24)"),
])
def test_tool_settings_are_checked_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, overrides)
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("name", ["tpu", "mps", "meta", "cuda:x", "cuda:-1", "CPU", ""])
def test_train_device_names_a_cpu_or_a_cuda_gpu(name):
    with pytest.raises(ConfigError, match=rf"train.device: got '{re.escape(name)}', expected"):
        load_config(None, [f"train.device={name}"])


def test_a_cuda_index_the_machine_lacks_is_one_line(monkeypatch):
    from r1fit.processes import DistributedError, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DistributedError, match="train.device=cuda:2 but this machine has 2 CUDA"):
        pick_device("cuda:2")


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("data:\n  system_prompt: caf\xe9\n".encode("latin-1"))
    # "data:\n  system_prompt: caf" is 26 bytes: the 27th, byte 26, is latin-1's e acute
    with pytest.raises(ConfigError, match=r"latin1.yaml: not a UTF-8 text file \(byte 26: "):
        load_config(path)


def test_an_empty_output_dir_is_refused():
    with pytest.raises(ConfigError, match="train.output_dir: got an empty value"):
        load_config(None, ["train.output_dir="])


@pytest.mark.parametrize("value", ["[]", "''"])
def test_an_empty_reward_method_names_the_key(value):
    with pytest.raises(ConfigError, match="data.reward_method: got"):
        load_config(None, [f"data.reward_method={value}"])


def test_an_integer_with_a_leading_zero_is_decimal(tmp_path) -> None:
    """YAML 1.1 (PyYAML) read 010 as octal 8, in files and overrides alike."""
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  num_generations: 012\n")
    assert load_config(str(path), []).algo.num_generations == 12
    cfg = load_config(None, ["algo.num_generations=010", "train.seed=0x10"])
    assert (cfg.algo.num_generations, cfg.train.seed) == (10, 16)  # hex stays hex
