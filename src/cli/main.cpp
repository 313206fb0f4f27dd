// flashmoe: the command-line front end. Parses, dispatches to a subcommand,
// and turns every user-caused failure into one message and a non-zero exit.
#include <csignal>
#include <cstdio>
#include <map>

#include "cli/command.h"
#include "core/error.h"
#include "runtime/device.h"

namespace flashmoe::cli {

static std::multimap<int, CommandSetup>& registry() {
  static std::multimap<int, CommandSetup> r;
  return r;
}

Registrar::Registrar(int order, CommandSetup setup) { registry().emplace(order, std::move(setup)); }

std::vector<CommandSetup> registered_commands() {
  std::vector<CommandSetup> out;
  for (auto& kv : registry()) out.push_back(kv.second);
  return out;
}

}  // namespace flashmoe::cli

int main(int argc, char** argv) {
  // A file size limit (ulimit -f) would kill the process mid-write with
  // SIGXFSZ; ignored, the write fails with EFBIG and the command reports it
  // and cleans up (pack removes its temporary directory).
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"flashmoe: inference for Qwen3.5 / Qwen3-Next hybrid-attention MoE models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "flashmoe 0.1.0");
  for (auto& setup : flashmoe::cli::registered_commands()) setup(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const flashmoe::DeviceError& e) {
    // The device's own message names what failed; the advice is the command line's.
    std::fprintf(stderr, "flashmoe: error: %s; %s\n", e.what(), flashmoe::device_advice(e.kind()).c_str());
    return 1;
  } catch (const flashmoe::Error& e) {
    std::fprintf(stderr, "flashmoe: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flashmoe: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashmoe: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
