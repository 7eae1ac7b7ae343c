// cmd_viz.cpp: `moetron viz pipeline` draws a pipeline schedule's timeline (pp_vis) as a self-contained
// HTML page plus an SVG: from a simulated schedule (the flags of `moetron schedule show`, tools/schedule_flags.h)
// from a Primus pp_vis dump (--primus DIR), or from a profiled run's measured steps (--run DIR, the trainer's
// pipeline_record.json); --export-primus DIR writes the timeline in Primus's dump format.
// Not the renderer itself (src/viz/) and not the simulator (src/schedule/).
#include <cstdio>
#include <memory>
#include <string>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/pipeline_record.h"
#include "moetron/schedule.h"
#include "schedule_compare.h"
#include "schedule_flags.h"
#include "viz/ppvis.h"

namespace {
using namespace moetron;

struct VizArgs {
  cli::ScheduleFlags flags;
  std::string run;
  int64_t run_step = -1;
  std::string primus;
  int primus_iteration = -1;
  std::string out = "pipeline.html";
  std::string export_primus;
  int width = 1400;
};

void run(const VizArgs& a) {
  viz::Timeline t;
  if (!a.primus.empty()) {
    t = viz::read_primus(a.primus, a.primus_iteration);
  } else if (!a.run.empty()) {  // a profiled run's measured step (the last recorded unless --step)
    const std::string path = cli::record_path(a.run);
    const sched::PipelineRecord r = sched::read_record(path);
    MT_CHECK(!r.steps.empty(), "viz pipeline", path, " holds no recorded steps");
    size_t k = r.steps.size() - 1;
    if (a.run_step >= 0) {
      k = r.steps.size();
      for (size_t i = 0; i < r.steps.size(); ++i)
        if (r.steps[i].step == a.run_step) k = i;
      MT_CHECK(k < r.steps.size(), "viz pipeline", "step ", a.run_step, " is not recorded in ", path, " (steps ",
               r.steps.front().step, "..", r.steps.back().step, ")");
    }
    t = viz::from_simulation(r.lowered, sched::measured_result(r, k),
                             "measured, step " + std::to_string(r.steps[k].step) + " of " + path, "s");
    t.title = "measured " + r.schedule_name;
    viz::derive_stats(t);
  } else {
    const sched::Schedule s = cli::schedule_from_flags(a.flags);
    const sched::Durations d = cli::parse_durations(a.flags.durations, s.n_stages);
    const sched::TimedResult r = sched::simulate_timed(s, d);
    const std::string dur = a.flags.durations.empty() ? "1,2,1,0" : a.flags.durations;
    t = viz::from_simulation(s, r, "simulated, durations F,B,W,P2P[,A2A] = " + dur);
  }
  viz::RenderOptions o;
  o.width = a.width;
  const std::string svg = viz::write_html_and_svg(t, a.out, o);
  std::printf("pp_vis: %s, pp %d, vpp %d, m %d, step %.6g %s, bubble %.2f%%\n", t.title.c_str(), t.pp, t.vpp,
              t.microbatches, t.step_time, t.unit.c_str(), 100.0 * t.bubble_ratio);
  for (const viz::RankRow& row : t.ranks)
    std::printf("rank %d: busy %.6g, bubble %.2f%%, peak in-flight %d (%.3g micro-batches)\n", row.rank, row.busy,
                100.0 * row.bubble_ratio, row.peak_inflight, t.peak_microbatches(row.rank));
  std::printf("wrote %s and %s\n", a.out.c_str(), svg.c_str());
  if (!a.export_primus.empty()) {
    viz::write_primus(t, a.export_primus);
    std::printf("wrote Primus pp_vis dump %s (config.json, pp_rank_0..%d.json)\n", a.export_primus.c_str(),
                t.pp - 1);
    // Primus's tool builds its default colour table from num_mbs // pp_size groups per chunk; with several
    // chunks and a remainder the table is short and its drawing fails, whatever the dump holds.
    if (t.vpp > 1 && t.microbatches % t.pp != 0)
      std::printf("note: Primus's pp_vis tool prints this dump's bubbles but cannot draw it: with vp_size %d > 1 "
                  "it draws only when num_mbs (%d) is a multiple of pp_size (%d)\n",
                  t.vpp, t.microbatches, t.pp);
  }
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* viz = root.add_subcommand("viz", "Pictures of a training job (pipeline timelines)");
  viz->require_subcommand(1);
  auto* c = viz->add_subcommand(
      "pipeline", "Draw a pipeline schedule's timeline (one row per rank) as a self-contained HTML page and an "
                  "SVG, from a simulated schedule or a Primus pp_vis dump");
  auto a = std::make_shared<VizArgs>();
  moetron::cli::add_schedule_flags(c, a->flags);
  auto* primus = c->add_option("--primus", a->primus,
                               "Draw a Primus pp_vis dump (DIR with config.json and pp_rank_<r>.json) instead "
                               "of simulating");
  auto* iter = c->add_option("--primus-iteration", a->primus_iteration,
                             "Iteration of the dump to draw (default: the largest in pp_rank_0.json)")
                   ->check(CLI::NonNegativeNumber);
  iter->needs(primus);
  auto* run_opt = c->add_option("--run", a->run,
                            "Draw a measured step of a profiled run (DIR/pipeline_record.json, written by "
                            "`moetron train --profile`)");
  c->add_option("--step", a->run_step, "Recorded step to draw (default: the last)")->needs(run_opt);
  run_opt->excludes(primus);
  // The schedule flags describe a simulation; with --primus or --run they would be ignored, so they are refused.
  for (const char* name : {"--pp", "--vpp", "--microbatches", "--schedule", "--group-size", "--ep-overlap", "--csv", "--durations"})
    primus->excludes(c->get_option(name)), run_opt->excludes(c->get_option(name));
  c->add_option("--out", a->out, "Output HTML page; the SVG goes next to it with the extension .svg")
      ->capture_default_str();
  c->add_option("--export-primus", a->export_primus, "Also write the timeline as a Primus pp_vis dump in DIR");
  c->add_option("--width", a->width, "Picture width in pixels")->check(CLI::Range(480, 20000))->capture_default_str();
  c->callback([a] { run(*a); });
});
