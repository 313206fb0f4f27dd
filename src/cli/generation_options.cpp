#include "cli/generation_options.h"

#include <algorithm>
#include <random>

#include "cli/validators.h"
#include "core/error.h"

namespace flashmoe::cli {

void add_generation_options(CLI::App* cmd, GenerationFlags* f) {
  const char* g = "Generation";
  cmd->add_option("-n,--n-predict", f->n_predict, "Maximum new tokens (default 256)")->check(integer_between(0, 2147483647))->group(g);
  cmd->add_option("-c,--ctx-size", f->ctx_size, "Context limit in tokens (default: the model's max_position_embeddings)")
      ->check(integer_at_least(0))->group(g);
  cmd->add_option("--temp", f->temp, "Temperature; 0 = greedy (default: generation_config.json, else 0.7)")
      ->check(at_least(0))->group(g);
  cmd->add_option("--top-k", f->top_k, "Keep the k most likely tokens (0 = off)")->check(integer_between(0, 2147483647))->group(g);
  cmd->add_option("--top-p", f->top_p, "Nucleus sampling threshold (1 = off)")->check(between(0, 1))->group(g);
  cmd->add_option("--min-p", f->min_p, "Drop tokens below min-p x the top probability (0 = off)")
      ->check(between(0, 1))->group(g);
  cmd->add_option("--repeat-penalty", f->repeat_penalty, "Repetition penalty, HF semantics (1 = off)")
      ->check(greater_than(0))->group(g);
  cmd->add_option("--presence-penalty", f->presence_penalty, "Subtracted once from every token already seen")->check(any_number())->group(g);
  cmd->add_option("--frequency-penalty", f->frequency_penalty, "Subtracted per occurrence of a token already seen")->check(any_number())->group(g);
  cmd->add_option("--seed", f->seed, "Random seed (same seed, same output; default: random)")->check(unsigned_integer())->group(g);
  cmd->add_option("--stop", f->stop, "Stop string (repeatable); it is not printed")->group(g);
  cmd->add_flag("--ignore-eos", f->ignore_eos,
                "Do not stop at end-of-sequence tokens: generate -n tokens unless a stop string or the context "
                "limit (-c) ends it first (EOS tokens are still fed to the model, their text is not printed)")
      ->group(g);
  add_speculative_options(cmd, &f->mtp, &f->spec_draft);
}

void add_speculative_options(CLI::App* cmd, bool* mtp, std::optional<int>* draft) {
  const char* g = "Speculative decoding";
  cmd->add_flag("--mtp", *mtp,
                "Speculative decoding with the model's multi-token-prediction head (mtp.* tensors; CPU and CUDA): "
                "the same output, several tokens per forward pass when the drafts are accepted")
      ->group(g);
  cmd->add_option("--spec-draft", *draft,
                  "With --mtp: tokens drafted per pass (default " + std::to_string(kDefaultSpecDraft) + ")")
      ->check(integer_between(1, 16))->group(g);
}

int spec_draft_from_flags(bool mtp, const std::optional<int>& draft) {
  if (draft && !mtp) fail("--spec-draft needs --mtp");
  return mtp ? draft.value_or(kDefaultSpecDraft) : 0;
}

GenerateOptions make_generate_options(const GenerationFlags& f, const ModelFiles& files,
                                      const std::vector<int32_t>& extra_eos, int64_t model_max_ctx) {
  SamplingParams base;
  base.temperature = 0.7f;  // used when generation_config.json does not say
  base.top_p = 0.95f;
  SamplingParams p = files.generation_config.empty() ? base : load_generation_config(files.generation_config, base);
  if (f.temp) p.temperature = *f.temp;
  if (f.top_k) p.top_k = *f.top_k;
  if (f.top_p) p.top_p = *f.top_p;
  if (f.min_p) p.min_p = *f.min_p;
  if (f.repeat_penalty) p.repetition_penalty = *f.repeat_penalty;
  p.presence_penalty = f.presence_penalty;
  p.frequency_penalty = f.frequency_penalty;
  p.seed = f.seed ? *f.seed : std::random_device{}();
  for (int32_t e : extra_eos)
    if (e >= 0 && std::find(p.eos_ids.begin(), p.eos_ids.end(), e) == p.eos_ids.end()) p.eos_ids.push_back(e);
  if (f.ignore_eos) p.eos_ids.clear();  // the generate loop stops only on the ids listed here
  GenerateOptions o;
  o.max_new_tokens = f.n_predict;
  o.sampling = p;
  o.stop = f.stop;
  o.spec_draft = spec_draft_from_flags(f.mtp, f.spec_draft);
  if (model_max_ctx > 0 && f.ctx_size > model_max_ctx)
    fail("--ctx-size must be between 1 and " + std::to_string(model_max_ctx) +
         ", the model's context (max_position_embeddings) (got " + std::to_string(f.ctx_size) + ")");
  o.context_limit = f.ctx_size > 0 ? f.ctx_size : model_max_ctx;
  return o;
}

}  // namespace flashmoe::cli
