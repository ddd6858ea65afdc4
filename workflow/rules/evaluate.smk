# One evaluation per model named in evaluate.models (base, sft, dpo or an rl variant) and, for the methods
# (dpo, rl variants), per seed of the grid; base and sft are evaluated once, with the shared seed.
rule evaluate:
    input:
        unpack(evaluate_inputs),
        model=model_dir,
        reference=rules.base_model.output[0],
        data=preprocessed("prompts"),
    output:
        directory(f"{RESULTS}/evaluate/{{model}}/seed{{seed}}"),
    wildcard_constraints:
        model="|".join(["base", *["sft"] * STAGES["sft"], *SEEDED_MODELS]),
        seed=r"\d+",
    log:
        f"{RESULTS}/logs/evaluate-{{model}}-seed{{seed}}.log",
    params:
        stage=stage_key("evaluate", derive=lambda wc: {"evaluate": evaluate_params(config)}),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
