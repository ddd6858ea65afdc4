# One run per entry of rl.variants (e.g. grpo, ppo) and seed of the grid (`seeds`); a variant's cache key is
# its own merged settings, so changing one variant reruns only that variant's runs and what depends on them.
rule rl:
    input:
        unpack(rl_reward_inputs),
        model=start_model,
        data=preprocessed("prompts"),
    output:
        directory(f"{RESULTS}/rl/{{variant}}/seed{{seed}}"),
    wildcard_constraints:
        variant="|".join(RL_VARIANTS) or "(?!)",  # (no variants: no rl job)
        seed=r"\d+",
    priority: PRIORITY["rl"]
    log:
        f"{RESULTS}/logs/rl-{{variant}}-seed{{seed}}.log",
    params:
        stage=stage_key("rl", derive=lambda wc: {"rl": rl_variant(config, wc.variant)}),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
