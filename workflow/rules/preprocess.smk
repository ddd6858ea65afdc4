# One job per dataset the DAG reads (launcher/config.dag_stages): sft, pairs, prompts (with the eval prompts). Each
# job's cache key is its own datasets and the formatting keys, so adding a dataset reruns only what reads it.
rule preprocess:
    input:
        model=rules.base_model.output[0],
        datasets=dataset_files,
    output:
        directory(f"{RESULTS}/preprocess/{{dataset}}"),
    wildcard_constraints:
        dataset="|".join(STAGES["datasets"]),
    log:
        f"{RESULTS}/logs/preprocess-{{dataset}}.log",
    params:
        stage=stage_key("preprocess", derive=lambda wc: preprocess_params(config, wc.dataset)),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
