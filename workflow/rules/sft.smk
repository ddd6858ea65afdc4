rule sft:
    input:
        model=rules.base_model.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/sft"),
    log:
        f"{RESULTS}/logs/sft.log",
    params:
        stage=stage_key("sft", "sft", "seed"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
