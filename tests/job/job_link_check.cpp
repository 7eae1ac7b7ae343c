// job_link_check.cpp: proof that the job library stands alone. Linked against moetron_job only (never the
// engine library `moetron`), it loads configs/deepseek_v3.toml and runs what a planner needs: count_params,
// flops_per_token, activation_bytes, estimate_memory, resolve_pipeline. If it links, the job library needs no
// kernel and no model; the checks below make it a test as well (exit 1 on a wrong figure).
// Not a unit test of the accounting (tests/unit/test_accounting.cpp, test_memcheck.cpp hold those).
#include <cstdio>
#include <string>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/kernel_sizes.h"

using namespace moetron;

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("  %-66s %s\n", what, ok ? "ok" : "FAILED");
  if (!ok) ++failures;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : std::string(MOETRON_SOURCE_DIR) + "/configs/deepseek_v3.toml";
  try {
    const JobConfig c = load_config(path);
    const ParamCounts pc = count_params(c.model);
    const FlopsPerToken f = flops_per_token(c.model, c.training.seq_len, true, c.activation_checkpoint);
    const ActivationBytes act = activation_bytes(c);
    const MemoryEstimate m = estimate_memory(c, 2, 1);
    const PipelineSetup p = resolve_pipeline(c);
    std::printf("%s (%s)\n", c.job.name.c_str(), path.c_str());
    std::printf("  total params %lld, active %lld (no embedding %lld)\n", (long long)pc.total, (long long)pc.active,
                (long long)pc.active_no_embed);
    std::printf("  train FLOPs per token %.6g (forward %.6g)\n", f.train, f.fwd());
    std::printf("  activation bytes per micro-batch %lld\n", (long long)act.total);
    std::printf("  memory per rank (bf16, 1 thread): params %.6g grads %.6g optimizer %.6g activations %.6g "
                "workspace %.6g comm %.6g peak %.6g\n",
                m.params, m.grads, m.optimizer, m.activations, m.workspace, m.comm, m.peak());
    std::printf("  pipeline: %d stage(s) per rank, %lld micro-batches, layout %d stage(s)\n", p.stages_per_rank,
                (long long)p.microbatches, p.layout.n_stages);
    if (c.job.name == "deepseek_v3") {
      // Published: 671B total and 37B active (DeepSeek-V3 technical report); the config's header says
      // moetron counts 671.0B / 37.6B.
      expect(pc.total > 670.5e9 && pc.total < 671.5e9, "total params in (670.5B, 671.5B)");
      expect(pc.active > 37e9 && pc.active < 38e9, "active params in (37B, 38B)");
      // Training is 3 forward passes; the forward is at least 2 FLOPs per active weight.
      expect(f.train == 3 * f.fwd() && f.fwd() >= 2.0 * double(pc.active_no_embed), "train = 3 x fwd >= 6 x active");
      // One rank holding everything (dp = ep = 1): AdamW keeps m and v in fp32 for every trained parameter,
      // and there is one fp32 gradient each. The aux-free expert biases (one per expert of each of the 58
      // MoE layers) are counted by count_params but are not trained.
      const double trained = double(pc.total) - 58.0 * 256.0;
      expect(m.optimizer == 8.0 * trained, "optimizer bytes = 8 x (total params - aux-free biases)");
      expect(m.grads == 4.0 * trained, "gradient bytes = 4 x (total params - aux-free biases)");
      // The kernel workspace is at least the attention's (same shared size arithmetic as the kernel).
      AttnWorkspaceShape aw;
      aw.B = c.training.micro_batch_size, aw.T = c.training.seq_len, aw.Hkv = c.model.attn.kv_heads();
      aw.Dqk = c.model.attn.qk_head_dim(), aw.Dv = c.model.attn.v_dim();
      expect(m.workspace > double(attention_workspace_size(aw, 1)), "workspace > attention workspace");
      // pp = 1: one stage with every layer; micro-batches = global batch / (micro-batch * dp).
      expect(p.stages_per_rank == 1 && p.layout.n_layers() == c.model.n_layers, "one stage holding all 61 layers");
      expect(p.microbatches == c.training.global_batch_size / c.training.micro_batch_size,
             "micro-batches = global / micro batch size");
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "job_link_check: %s\n", e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
