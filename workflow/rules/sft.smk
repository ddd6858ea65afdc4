rule sft:
    input:
        unpack(given_model("sft")),
        unpack(lambda wc: {"data": preprocessed("sft")} if "sft" in STAGES["datasets"] else {}),
        model=rules.base_model.output[0],
    output:
        directory(f"{RESULTS}/sft"),
    message:
        f"sft: using the given model {config['sft']['from']} (not trained)" if config["sft"]["from"] else None
    priority: PRIORITY["sft"]
    log:
        f"{RESULTS}/logs/sft.log",
    params:
        stage=stage_key("sft", "sft", "seed"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
