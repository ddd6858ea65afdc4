# alignpipe: the DAG of an RLHF experiment. Each rule wires files and params; the work lives in stages/.
#   make demo                                              # the demo (config/default.yaml), local executor
#   .venv/bin/snakemake --profile cluster_profiles/local all --configfile config/tiny.yaml
# An experiment file stands on its own, read over the schema's defaults; the demo is read only when no --configfile
# is given (to start from it: --configfile config/default.yaml mine.yaml). The DAG holds the stages the config asks
# for (the schema's header says which).
if not workflow.config_settings.configfiles:
    workflow.configfile("config/default.yaml")
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/base_model.smk"
include: "workflow/rules/preprocess.smk"
include: "workflow/rules/sft.smk"
include: "workflow/rules/reward_model.smk"
include: "workflow/rules/dpo.smk"
include: "workflow/rules/rl.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        rules.report.output,
    default_target: True
