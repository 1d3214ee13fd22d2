"""kvlab.common: config, model, scheduler, runner, sampler, kernel registry, metrics and the LLM API."""
