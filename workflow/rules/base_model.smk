rule base_model:
    output:
        directory(f"{RESULTS}/base_model"),
    log:
        f"{RESULTS}/logs/base_model.log",
    params:
        stage=stage_key("base_model", "model", "seed"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
