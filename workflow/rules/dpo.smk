# One DPO run per seed of the grid (`seeds`), all from the same start model (SFT's, or the base model without SFT).
rule dpo:
    input:
        model=start_model,
        data=preprocessed("pairs"),
    output:
        directory(f"{RESULTS}/dpo/seed{{seed}}"),
    wildcard_constraints:
        seed=r"\d+",
    priority: PRIORITY["dpo"]
    log:
        f"{RESULTS}/logs/dpo-seed{{seed}}.log",
    params:
        stage=stage_key("dpo", "dpo"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
