rule preprocess:
    input:
        model=rules.base_model.output[0],
        datasets=dataset_files,
    output:
        directory(f"{RESULTS}/preprocess"),
    log:
        f"{RESULTS}/logs/preprocess.log",
    params:
        stage=stage_key("preprocess", "data", "seed"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
