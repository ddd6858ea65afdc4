rule reward_model:
    input:
        model=rules.sft.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/reward_model"),
    log:
        f"{RESULTS}/logs/reward_model.log",
    params:
        stage=stage_key("reward_model", "reward_model", "seed"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
