# The paper's tables and figures, built from the MLflow runs of the stages below (each input's stage.json names
# its run). `snakemake --report <file>.html` packs the figures and tables with the rule graph and captions.
rule report:
    input:
        unpack(report_inputs),
    output:
        report(directory(f"{RESULTS}/report"), patterns=["{name}.png", "{name}.csv"],
               caption="../report/results.rst", category="Results"),
    log:
        f"{RESULTS}/logs/report.log",
    params:
        stage=stage_key("report", derive=lambda wc: report_params(config)),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
