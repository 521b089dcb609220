"""Every setting of the trainer, declared once: a field of `Config` with its type and default, and in its
metadata its `--help` line, its range or choices, its TRL names, and which part of the run reads it. The rest
is derived from here: the flags (run_config.build_parser), the TRL mapping (trl_names.RENAMED, SAME_NAME,
TRL_DEFAULTS), the checks of each value on its own (run_config.validate; checks across settings are code there)
and the table of docs/trainer.md#every-setting (settings_docs.py).

Neither torch nor anything else of the trainer is imported here: `--help` reads this module.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import List, NamedTuple, Optional

FLOAT32_MAX = 3.4028234663852886e38  # the policy's logits, log-probs and rewards are float32
REWARD_FORMS = ("exact | regex:PATTERN | package.module:function | path/to/file.py:function | trl grpo's "
                "accuracy_reward, reasoning_accuracy_reward, think_format_reward or get_soft_overlong_punishment")
MAX_DIGITS = 3  # the demo task lists all 10^(2·digits) operand pairs: 4 digits would take tens of GB
MAX_LR = 1.0  # --lr and --warmup-lr at most (AdamW moves each weight by about lr a step: more wrecks any model)
# verl 0.9.1's advantage estimators (its AdvantageEstimator) that the trainer forms with rlkernels.advantages; the
# *_vectorized ones are verl's second implementations of the same estimator
ADV_ESTIMATORS = ("gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk", "gdpo")
# who reads a setting: the parts of config_parts.py, the loss (config_parts.loss_config), the set-up from the whole
# Config (startup.py: the model, rewards, devices), the checkpoint, or only the config's own code (run_config.py)
READERS = ("data", "warmup", "sampling", "optimization", "logging", "advantages", "loss", "setup", "checkpoint",
           "config")


class Bounds(NamedTuple):
    """The range of a number: `at_least` or `above` its lower end, `at_most` or `below` its upper one."""
    at_least: Optional[float] = None
    above: Optional[float] = None
    at_most: Optional[float] = None
    below: Optional[float] = None

    def holds(self, v) -> bool:
        return ((self.at_least is None or v >= self.at_least) and (self.above is None or v > self.above) and
                (self.at_most is None or v <= self.at_most) and (self.below is None or v < self.below))

    def text(self, integer: bool = False) -> str:
        """As the errors say it: `>= 1`, `> 0`, `in [0, 1)`, `in (0, 1]`, `from 0 to 9` (an int's closed range)."""
        low = self.at_least if self.at_least is not None else self.above
        high = self.at_most if self.at_most is not None else self.below
        if high is None:
            return f"{'>=' if self.at_least is not None else '>'} {_number(low)}"
        if low is None:
            return f"{'<=' if self.at_most is not None else '<'} {_number(high)}"
        if integer and self.at_least is not None and self.at_most is not None:
            return f"from {_number(low)} to {_number(high)}"
        return (f"in {'[' if self.at_least is not None else '('}{_number(low)}, "
                f"{_number(high)}{']' if self.at_most is not None else ')'}")


def _number(x) -> str:
    if isinstance(x, int):
        return f"2**{x.bit_length()} - 1" if x > 2**16 and not x & (x + 1) else str(x)  # a seed's 2**32 - 1
    return f"{x:g}".replace("e+0", "e").replace("e+", "e")


_UNSET = object()


def _field(default, help: str, *, reads: tuple, mode: Optional[tuple] = None, choices: Optional[tuple] = None,
           trl: tuple = (), former: tuple = (), trl_default=_UNSET, demo_only: bool = False,
           on_resume: Optional[str] = None, loss_field: bool = False, **bounds):
    """A setting: its default and help (`help_line` adds what the rest declares), and
    * reads: who reads it (READERS);
    * mode: (the demo's value, a --model run's) of a setting whose default is None;
    * choices: the values it takes; bounds: at_least / above / at_most / below (Bounds), for a number;
    * trl: TRL's names for it (its own name: GRPOConfig's setting of that name); former: our older names;
    * trl_default: GRPOConfig's (or ModelConfig's) default where it differs, which a TRL recipe starts from;
    * demo_only: a setting of the built-in model and task, refused with --model;
    * on_resume: "kept" (fixes the saved weights' shapes or the objective) or "fresh" (the machine's, never the
      checkpoint's);
    * loss_field: PolicyLossConfig's field of the same name, none = the preset's."""
    metadata = {"help": help, "reads": reads, "mode": mode, "choices": choices, "trl": trl, "former": former,
                "demo_only": demo_only, "on_resume": on_resume, "loss_field": loss_field,
                "bounds": Bounds(**bounds) if bounds else None}
    if trl_default is not _UNSET:
        metadata["trl_default"] = trl_default
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class Config:
    # run
    out: str = _field("", "output folder; \"\" = runs/<timestamp>", trl=("output_dir",), reads=("logging", "setup"))
    # torch.manual_seed takes 64 bits, and the trainer derives seed·1000 + rank
    seed: int = _field(0, "random seed",
                       at_least=0, at_most=2**32 - 1, trl=("seed",), trl_default=42, reads=("data",))
    threads: int = _field(0, "torch threads; 0 = 1 for the demo model, else min(cpu count, 4) / ranks",
                          at_least=0, reads=("setup",))
    resume: str = _field("", "a run folder (or checkpoint file) to continue exactly",
                         on_resume="fresh", reads=("setup",))
    trust_checkpoint_code: bool = _field(False, "--resume: import the --reward files and modules and the --plugin "
                                                "code the checkpoint names (without it, only code this command "
                                                "line names is run)", on_resume="fresh", reads=("config",))
    overwrite: bool = _field(False, "replace the run that --out holds: what its runs wrote goes once this one has "
                                    "its first checkpoint, your own files stay (without it, such a folder is "
                                    "refused: --resume continues it)", on_resume="fresh", reads=("setup",))
    progress: bool = _field(True, "show a tqdm progress bar (--progress false to hide it)", reads=("warmup", "logging"))
    device: str = _field("auto", "auto (cuda if available, else cpu) | cpu | cuda | cuda:N; under torchrun cuda is "
                                 "cuda:LOCAL_RANK. A resumed run takes this from its own flags",
                                 on_resume="fresh", reads=("setup",))
    dtype: str = _field("auto", "forward passes under autocast: auto (bfloat16 on a GPU that has it, else float32) | "
                                "float32 | bfloat16; weights stay float32", trl=("torch_dtype",), reads=("setup",))
    # model; "" = the built-in tiny Llama with a character tokenizer (offline demo)
    model: str = _field("", "a local Hugging Face causal-LM folder; \"\" = the built-in tiny Llama with a character "
                            "tokenizer (the offline demo)",
                            trl=("model_name_or_path",), on_resume="kept", reads=("setup",))
    n_layer: int = _field(2, "demo model only: layers", at_least=1, demo_only=True, on_resume="kept", reads=("setup",))
    n_embd: int = _field(128, "demo model only: hidden size (a multiple of --n-head)",
                         at_least=1, demo_only=True, on_resume="kept", reads=("setup",))
    n_head: int = _field(4, "demo model only: attention heads",
                         at_least=1, demo_only=True, on_resume="kept", reads=("setup",))
    lora_rank: int = _field(0, "> 0: train LoRA adapters of this rank through peft",
                            at_least=0, on_resume="kept", reads=("setup",))
    lora_alpha: float = _field(16.0, "LoRA alpha", above=0, trl_default=32.0, reads=("setup",))
    lora_target: str = _field("all-linear", "LoRA modules: all-linear (every linear layer but the head) or name,name,...",
                              on_resume="kept", reads=("setup",))
    lora_dropout: float = _field(0.0, "LoRA dropout",
                                 at_least=0, below=1, trl_default=0.05, reads=("setup",))
    lora_target_parameters: List[str] = _field([], "LoRA on these parameters (peft's target_parameters, e.g. a "
                                                   "mixture of experts' stacked weights)",
                                                   on_resume="kept", reads=("setup",))
    lora_modules_to_save: List[str] = _field([], "modules trained in full beside the adapters (peft's "
                                                 "modules_to_save)", on_resume="kept", reads=("setup",))
    use_rslora: bool = _field(False, "LoRA: rank-stabilised scaling alpha/sqrt(r) (peft's use_rslora)",
                              reads=("setup",))
    use_dora: bool = _field(False, "LoRA: weight-decomposed adapters (peft's use_dora)",
                            on_resume="kept", reads=("setup",))
    attn_implementation: Optional[str] = _field(None, "with --model: the attention kernel from_pretrained loads "
                                                      "(eager | sdpa | flash_attention_2 | ...); none = transformers' "
                                                      "choice", reads=("setup",))
    chat_template: Optional[str] = _field(None, "with --model: a Jinja chat template that replaces the tokenizer's "
                                                "(open-r1's chat_template); saved with the run's tokenizer",
                                                reads=("setup",))
    merge_lora: bool = _field(False, "save the merged weights, not the adapter (the demo model is always merged)",
                              reads=("checkpoint",))
    gradient_checkpointing: bool = _field(False, "recompute each layer's activations in the backward (HF's, "
                                                 "non-reentrant): less memory for longer sequences, about one more "
                                                 "forward of time",
                                                 trl=("gradient_checkpointing", "activation_checkpointing"),
                                                 trl_default=True, reads=("setup",))
    fsdp: bool = _field(False, "under torchrun: shard the policy, critic and reference model over the ranks with "
                               "FSDP2 (fully_shard per decoder layer) instead of replicating them with DDP, for "
                               "models that do not fit one device", trl=("fsdp",), reads=("setup",))
    # data; "" = the demo's synthetic addition "a+b=" with `digits`-digit operands
    dataset: str = _field("", "a local .json/.jsonl/.csv/.parquet file or a `datasets` folder (save_to_disk, or data "
                              "files); a prompt column (a string or a conversation [{\"role\", \"content\"}, ...]) and "
                              "any others, e.g. answer; \"\" = the demo's synthetic addition (required with --model)",
                              trl=("dataset_name",), former=("prompts",), reads=("data",))
    dataset_split: str = _field("train", "the split of --dataset to train on (a single file has only train)",
                                trl=("dataset_train_split",), reads=("data",))
    prompt_column: str = _field("prompt", "the column of --dataset (and --eval-dataset) holding the prompts",
                                trl=("dataset_prompt_column",), reads=("data",))
    dataset_config: Optional[str] = _field(None, "the configuration (subset) of a --dataset folder or Hub dataset "
                                                 "(TRL's dataset_config, load_dataset's name)", reads=("data",))
    system_prompt: Optional[str] = _field(None, "a system message before every prompt (open-r1's): a string prompt "
                                                "becomes the conversation [system, user]", reads=("data",))
    eval_dataset: str = _field("", "held-out prompts, as --dataset; \"\" = --eval-size prompts of --dataset held out "
                                   "(or its --eval-split)", reads=("data",))
    eval_split: str = _field("", "the split of --eval-dataset, or of --dataset without it; \"\" = train of "
                                 "--eval-dataset, and without either flag the held-out rows of --dataset",
                                 trl=("dataset_test_split",), reads=("data",))
    # rewards; several as --reward A B or --reward A --reward B; none given = exact (none at all with --reward-model)
    reward: List[str] = _field([], f"{REWARD_FORMS}: a function (prompt, completion, answer) -> float, or TRL's "
                                   "(prompts, completions, **columns) -> list[float], every dataset column as a keyword "
                                   "argument; None = not applicable to that completion; several as --reward A B; none "
                                   "given = exact (none at all with --reward-model)",
                                   trl=("reward_funcs",), reads=("setup",))
    reward_model: str = _field("", "a local sequence-classification model folder (one label) scoring prompt + "
                                   "completion", trl=("reward_model_name_or_path",), reads=("setup",))
    # one weight per reward, the --reward functions then --reward-model; [] = all 1.0. A completion's reward
    # is Σ weight·reward over those that did not return None
    reward_weights: List[float] = _field([], "one weight per reward, the --reward functions then --reward-model; "
                                             "none = all 1.0. A completion's reward is the sum of weight·reward over "
                                             "those that did not return None",
                                             trl=("reward_weights",), reads=("setup",))
    multi_objective_aggregation: str = _field(
        "sum_then_normalize", "several rewards, as TRL's option of that name: sum_then_normalize (the weighted sum, "
        "then the advantages of --algo) | normalize_then_sum (GDPO, GRPO family: each reward normalised within its "
        "prompt group, the weighted sum of those normalised over the whole batch)",
        choices=("sum_then_normalize", "normalize_then_sum"), trl=("multi_objective_aggregation",),
        reads=("advantages",))
    digits: int = _field(2, f"demo task only: operand digits of the synthetic addition (at most {MAX_DIGITS})",
                         at_least=1, demo_only=True, reads=("setup",))
    eval_size: Optional[int] = _field(None, "held-out prompts evaluated (greedy completions) at most; 0 = "
                                                        "no evaluation (a TRL recipe that asks for none)",
                                                        mode=(256, 64), at_least=0, reads=("data",))
    eval_holdout: bool = _field(True, "hold the --eval-size prompts of --dataset out of training; false: evaluate on "
                                      "training prompts (a TRL recipe that asks for no evaluation)", reads=("data",))
    # supervised warm-up (demo task only): stops at a target held-out accuracy, so that RL starts from a comparable
    # point on every seed and has room to improve
    warmup_steps: int = _field(600, "demo: supervised warm-up steps before RL at most (fewer once --warmup-target is "
                                    "reached); with --model, TRL's warmup_steps: --lr-warmup-steps",
                                    at_least=0, trl=("warmup_steps",), reads=("warmup",))
    warmup_target: Optional[float] = _field(0.35, "demo model only: stop the warm-up once the held-out greedy reward "
                                                  "(accuracy) reaches this at two checks in a row, one every "
                                                  "--warmup-eval-every steps; none = all --warmup-steps",
                                                  demo_only=True, reads=("warmup",))
    # 5, not 10: checks 10 steps apart let seed 0 pass the target between two and stop at 0.63 (RESULTS.md)
    warmup_eval_every: int = _field(5, "demo model only: warm-up steps between checks of --warmup-target",
                                    at_least=1, demo_only=True, reads=("warmup",))
    warmup_batch: int = _field(64, "demo model only: warm-up batch size", at_least=1, demo_only=True, reads=("warmup",))
    warmup_lr: float = _field(1e-3, "demo model only: warm-up learning rate",
                              above=0, at_most=MAX_LR, demo_only=True, reads=("warmup",))
    # RL
    algo: str = _field("grpo", "a preset of rlkernels.presets (docs/math.md §9: ppo, grpo, dr_grpo, dapo, gspo, cispo, "
                               "sapo, vespo, ...; a wrong name lists them all), or one added by presets.register",
                               trl_default="dapo", on_resume="kept",
                               reads=("setup", "logging", "loss", "advantages"))
    plugin: List[str] = _field([], "Python files (path/to/file.py) or modules imported before the config is "
                                   "checked: one that registers an objective or a preset (rlkernels."
                                   "register_objective, presets.register) makes it an --algo; several as --plugin A B",
                               reads=("config",))
    steps: int = _field(150, "RL steps", at_least=1, trl=("max_steps",), reads=("optimization", "logging"))
    prompts_per_step: Optional[int] = _field(None, "prompts per RL step (per rank)",
                                             mode=(32, 8), at_least=1, reads=("sampling",))
    num_generations: int = _field(8, "completions per prompt (the GRPO group: at least 2; ppo takes 1)",
                                  at_least=1, trl=("num_generations",), trl_default=8, reads=("sampling", "setup"))
    max_new_tokens: Optional[int] = _field(None, "completion length at most",
                                           mode=(4, 256), at_least=1, trl=("max_completion_length",),
                                           trl_default=512, reads=("sampling", "advantages"))
    max_prompt_length: Optional[int] = _field(None, "with --model: a prompt longer than this many tokens keeps its last "
                                                    "ones (TRL's max_prompt_length), said in the log; none = whole "
                                                    "prompts (one beyond the model's context is an error)",
                                                    at_least=1, reads=("setup",))
    temperature: Optional[float] = _field(None, "sampling temperature",
                                          mode=(0.7, 1.0), above=0, trl=("temperature",),
                                          trl_default=1.0, reads=("sampling",))
    lr: Optional[float] = _field(None, "RL learning rate",
                                 mode=(1e-4, 1e-6), above=0, at_most=MAX_LR, trl=("learning_rate",),
                                 trl_default=1e-6, reads=("optimization",))
    lr_warmup_steps: int = _field(5, "RL learning rate ramps linearly from lr/N to lr over the first N steps",
                                  at_least=0, trl_default=0, reads=("optimization",))
    lr_scheduler_type: str = _field("constant", "after the warm-up: constant | linear (to 0 at the last step) | cosine",
                                    choices=("constant", "linear", "cosine"), trl=("lr_scheduler_type",),
                                    trl_default="linear", reads=("optimization",))
    weight_decay: float = _field(0.0, "AdamW weight decay", at_least=0, trl=("weight_decay",), reads=("setup",))
    adam_beta1: float = _field(0.9, "AdamW β1 of the RL optimizer",
                               at_least=0, below=1, trl=("adam_beta1",), reads=("setup",))
    adam_beta2: float = _field(0.98, "AdamW β2 of the RL optimizer",
                               at_least=0, below=1, trl=("adam_beta2",), trl_default=0.999, reads=("setup",))
    adam_epsilon: float = _field(1e-8, "AdamW ε of the RL optimizer", above=0, trl=("adam_epsilon",), reads=("setup",))
    train_epochs: Optional[float] = _field(None, "TRL's num_train_epochs without max_steps: passes over the training "
                                                 "prompts, which set --steps once --dataset is read",
                                                 above=0, at_most=1e6, reads=("setup",))
    epochs: int = _field(1, "μ: optimisation passes over each rollout batch",
                         at_least=1, trl=("num_iterations",), reads=("optimization",))
    minibatches: int = _field(2, "optimizer steps per epoch (split by prompt groups)",
                              at_least=1, reads=("optimization",))
    max_grad_norm: float = _field(1.0, "gradient clipping norm",
                                  above=0, trl=("max_grad_norm",), reads=("optimization",))
    kl_coef: Optional[float] = _field(None, "none = the preset's (grpo 0.04 k3 in the loss; ppo 0.05 k1 in the reward)",
                                      at_least=0, trl=("beta",), trl_default=0.0, reads=("loss", "setup"))
    # > 0: PPO divides the observed KL by the target
    kl_target: Optional[float] = _field(None, "PPO: adaptive β towards this KL; none = fixed β",
                                        above=0, reads=("optimization",))
    clip_low: Optional[float] = _field(None, "lower ratio clip; none = the preset's", at_least=0, reads=("loss",))
    clip_high: Optional[float] = _field(None, "upper ratio clip; none = the preset's", at_least=0, reads=("loss",))
    # TRL's loss settings, as PolicyLossConfig's fields of these names (rlkernels.integrations.trl maps them alike)
    delta: Optional[float] = _field(None, "the clip objectives: cap the unclipped ratio at δ (TRL's two-sided GRPO); "
                                          "none = no cap", trl=("delta",), loss_field=True, reads=("loss",))
    top_entropy_quantile: float = _field(1.0, "train only the tokens in this top fraction of entropy (TRL's, the "
                                              "80/20 rule); 1 = every token",
                                              trl=("top_entropy_quantile",), reads=("loss",))
    kl_bias_correction: bool = _field(False, "the KL term weighted by the importance ratio (TRL's "
                                             "use_bias_correction_kl)",
                                             trl=("use_bias_correction_kl",), trl_default=True, reads=("loss",))
    sapo_tau_pos: Optional[float] = _field(None, "sapo: τ+ (TRL's sapo_temperature_pos); none = the preset's",
                                           trl=("sapo_temperature_pos",), loss_field=True, reads=("loss",))
    sapo_tau_neg: Optional[float] = _field(None, "sapo: τ- (TRL's sapo_temperature_neg); none = the preset's",
                                           trl=("sapo_temperature_neg",), loss_field=True, reads=("loss",))
    vespo_k_pos: Optional[float] = _field(None, "vespo: k+; none = the preset's",
                                          trl=("vespo_k_pos",), loss_field=True, reads=("loss",))
    vespo_lambda_pos: Optional[float] = _field(None, "vespo: λ+; none = the preset's",
                                               trl=("vespo_lambda_pos",), loss_field=True, reads=("loss",))
    vespo_k_neg: Optional[float] = _field(None, "vespo: k-; none = the preset's",
                                          trl=("vespo_k_neg",), loss_field=True, reads=("loss",))
    vespo_lambda_neg: Optional[float] = _field(None, "vespo: λ-; none = the preset's",
                                               trl=("vespo_lambda_neg",), loss_field=True, reads=("loss",))
    entropy_coef: float = _field(0.0, "entropy bonus coefficient", trl=("entropy_coef",), reads=("loss",))
    scale_rewards: Optional[str] = _field(None, "GRPO family: group (divide by the group's std) | batch (by the batch's) | "
                                                "none; none given = none for dr_grpo, else group",
                                                choices=(None, "group", "batch", "none"), trl=("scale_rewards",),
                                                reads=("advantages",))
    adv_estimator: Optional[str] = _field(None, "the advantages, as verl's algorithm.adv_estimator: "
                                                "" + " | ".join(ADV_ESTIMATORS) + "; none = --algo's own (gae for ppo, "
                                                "Tree-GRPO with --tree, grpo otherwise)", reads=("advantages",))
    loss_path: str = _field("linear", "linear (from hidden states, no logits) | fused (fused_policy_loss) | split",
                            choices=("linear", "fused", "split"), reads=("setup",))
    # PPO critic
    critic: str = _field("shared", "PPO critic: shared (value head on the actor trunk) | separate (own trunk)",
                         choices=("shared", "separate"), on_resume="kept", reads=("setup",))
    vf_coef: float = _field(0.5, "PPO value-loss coefficient", reads=("optimization",))
    # > 0: value_loss needs a clip above 0
    vf_clip: Optional[float] = _field(0.2, "PPO value clip; none = unclipped", above=0, reads=("optimization",))
    gamma: float = _field(1.0, "discount of PPO's GAE and of --adv-estimator reinforce_plus_plus",
                          at_least=0, at_most=1, reads=("advantages",))
    lam: float = _field(0.95, "PPO GAE λ", at_least=0, at_most=1, reads=("advantages",))
    # options
    pods_keep: int = _field(0, "> 0: PODS, keep m of the num_generations rollouts per prompt",
                            at_least=0, reads=("sampling", "setup"))
    dynamic_sampling: bool = _field(False, "DAPO: drop groups whose rewards are all equal, sample more to refill",
                                    reads=("sampling",))
    max_gen_batches: int = _field(4, "dynamic sampling: rollout batches per step at most (then train on what is kept)",
                                  at_least=1, reads=("sampling",))
    overlong_buffer: int = _field(0, "> 0: DAPO overlong penalty over the last `buffer` tokens",
                                  at_least=0, reads=("sampling", "advantages"))
    mask_truncated_completions: bool = _field(False, "DAPO (TRL's option of that name): a completion that ends without "
                                                     "eos is left out of the loss (its tokens masked; its reward still "
                                                     "counts in its group's advantages)",
                                                     trl=("mask_truncated_completions",), reads=("sampling",))
    tree: bool = _field(False, "Tree-GRPO: branch continuations from sampled prefixes", reads=("sampling",))
    tree_roots: int = _field(2, "Tree-GRPO: trees per prompt (num_generations = roots × branches)",
                             at_least=1, reads=("sampling",))
    # logging / checkpoints
    logging_steps: int = _field(1, "a metrics row (metrics.jsonl, --report-to) every N steps, and at evals",
                                at_least=1, trl=("logging_steps",), trl_default=10, reads=("logging",))
    eval_every: int = _field(20, "evaluate every N steps", at_least=1, trl=("eval_steps",), reads=("logging",))
    eval_completions: int = _field(8, "held-out prompts whose greedy completion, answer and reward are logged at each "
                                      "eval (completions.jsonl; TensorBoard text, a W&B table); 0 = none",
                                      at_least=0, reads=("sampling",))
    report_to: List[str] = _field(["none"], "metrics and eval completions also to: none | tensorboard | wandb (several "
                                            "allowed; W&B offline unless WANDB_MODE says otherwise), besides "
                                            "metrics.jsonl and completions.jsonl",
                                            trl=("report_to",), reads=("logging",))
    ckpt_every: int = _field(50, "checkpoint every N steps (with --save-strategy steps)",
                             at_least=1, trl=("save_steps",), trl_default=500, reads=("logging",))
    save_strategy: str = _field("steps", "when to checkpoint (TRL's option): steps (every --ckpt-every steps) | epoch "
                                         "(after each pass over the training prompts) | no (only at the end: the final "
                                         "model and the checkpoint that --resume continues)",
                                         choices=("steps", "epoch", "no"), trl=("save_strategy",), reads=("setup",))

    def __post_init__(self):
        # a field of several values also takes one (Config(reward="exact"), and checkpoints from before the
        # list fields), and a list (from JSON)
        for name in MULTI:
            v = getattr(self, name)
            setattr(self, name, list(v) if isinstance(v, (list, tuple)) else [v])
        for name, (demo, model) in MODE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, model if self.model else demo)
        if str(self.save_strategy).lower() == "false":  # YAML 1.1 reads an unquoted `save_strategy: no` as false
            self.save_strategy = "no"
        if isinstance(self.scale_rewards, (bool, str)):  # TRL also takes true (group) and false (none)
            self.scale_rewards = {"true": "group", "false": "none"}.get(str(self.scale_rewards).lower(),
                                                                         self.scale_rewards)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
MULTI = tuple(n for n, t in typing.get_type_hints(Config).items() if typing.get_origin(t) is list)  # several values


def _having(key: str) -> dict:
    return {name: f.metadata[key] for name, f in FIELDS.items() if f.metadata.get(key) is not None}


CHOICES = _having("choices")
BOUNDS = _having("bounds")
# (the demo's, a --model run's): 2-digit sums need 4 tokens; a real model's answers need room, and TRL's
# temperature 1.0 samples the model's own distribution; a small learning rate for full fine-tuning
MODE_DEFAULTS = _having("mode")
DEMO_ONLY = tuple(n for n, f in FIELDS.items() if f.metadata["demo_only"])
RESUME_FIXED = tuple(n for n, kept in _having("on_resume").items() if kept == "kept")
RESUME_FRESH = tuple(n for n, kept in _having("on_resume").items() if kept == "fresh")
LOSS_FIELDS = tuple(n for n, f in FIELDS.items() if f.metadata["loss_field"])


def nullable(name: str) -> bool:
    """Whether a setting may be None (a `mode` setting's None becomes the demo's or the --model run's value)."""
    return type(None) in typing.get_args(typing.get_type_hints(Config)[name]) and name not in MODE_DEFAULTS


def value_type(name: str) -> type:
    """int, float, bool or str: the type of a setting's value (of each, for one of several values)."""
    hint = typing.get_type_hints(Config)[name]
    return typing.get_args(hint)[0] if typing.get_origin(hint) in (list, typing.Union) else hint


def expected(name: str) -> str:
    """What a bounded setting takes, as its error and its --help line say it: `an int >= 1`, `a number in (0, 1]`."""
    integer = value_type(name) is int
    return (f"{'an int' if integer else 'a number'} {BOUNDS[name].text(integer)}"
            f"{' or none' if nullable(name) else ''}")


def shown(value) -> str:
    """A value as --help and the docs write it: true, none, "", a list's items."""
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return ('""' if value == "" else "none" if value is None else str(value).lower() if isinstance(value, bool)
            else str(value))


def help_line(name: str) -> str:
    """`--help`'s line: the setting's help, then what its mode, bounds and TRL default declare."""
    meta = FIELDS[name].metadata
    parts = [meta["help"]]
    if meta["mode"]:
        parts.append(f"none = {shown(meta['mode'][0])} for the demo, {shown(meta['mode'][1])} with --model")
    if meta["bounds"]:
        parts.append(expected(name))
    if "trl_default" in meta:
        parts.append(f"a TRL recipe: {shown(meta['trl_default'])}")
    return "; ".join(parts)
