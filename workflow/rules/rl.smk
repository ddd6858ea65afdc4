# One run per entry of rl.variants (e.g. grpo, ppo) and seed of the grid (`seeds`); a variant's cache key is
# its own merged settings, so changing one variant reruns only that variant's runs and what depends on them.
RL_VARIANTS = list(config["rl"]["variants"])


def rl_reward_inputs(wildcards):
    reward = rl_variant(config, wildcards.variant)["reward"]
    return {"reward_model": rules.reward_model.output[0]} if reward == "model" else {"reward_file": reward}


rule rl:
    input:
        unpack(rl_reward_inputs),
        model=rules.sft.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/rl/{{variant}}/seed{{seed}}"),
    wildcard_constraints:
        variant="|".join(RL_VARIANTS),
        seed=r"\d+",
    params:
        stage=stage_key("rl", derive=lambda wc: {"rl": rl_variant(config, wc.variant)}),
        inputs=named_inputs,
    shell:
        LAUNCH
