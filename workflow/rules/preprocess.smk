rule preprocess:
    input:
        model=rules.base_model.output[0],
        preference_files=[f for f in (config["data"]["preference_train_file"], config["data"]["preference_eval_file"]) if f],
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
