# One DPO run per seed of the grid (`seeds`), all from the same SFT model.
rule dpo:
    input:
        model=rules.sft.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/dpo/seed{{seed}}"),
    wildcard_constraints:
        seed=r"\d+",
    log:
        f"{RESULTS}/logs/dpo-seed{{seed}}.log",
    params:
        stage=stage_key("dpo", "dpo"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
