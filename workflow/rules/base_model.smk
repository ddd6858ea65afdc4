rule base_model:
    input:
        # your own model directory (model.path): replacing its files reruns the experiment
        [config["model"]["path"]] if config["model"]["path"] and not is_hub(config["model"]["path"]) else [],
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
