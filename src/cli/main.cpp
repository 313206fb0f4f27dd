// flashmoe: the command-line front end. Parses, dispatches to a subcommand,
// and turns every user-caused failure into one message and a non-zero exit.
#include <csignal>
#include <cstdio>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <map>
#include <string>

#include "cli/command.h"
#include "core/cpu_features.h"
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

namespace {

// Every user error is one line "flashmoe: error: ..." and exit code 1 (README).
int user_error(const std::string& what) {
  std::fprintf(stderr, "flashmoe: error: %s\n", what.c_str());
  return 1;
}

// CLI11's message for a parse error, on one line, naming the option once:
// a failed validator (cli/validators.h) reads "--temp: must be >= 0 (got -1)"
// and becomes "--temp must be >= 0 (got -1)".
std::string parse_error_message(const CLI::ParseError& e) {
  std::string msg = e.what();
  if (dynamic_cast<const CLI::ValidationError*>(&e)) {
    const size_t p = msg.find(": must be ");
    if (p != std::string::npos) msg.erase(p, 1);
  }
  for (char& c : msg)
    if (c == '\n' || c == '\r') c = ' ';
  while (!msg.empty() && msg.back() == ' ') msg.pop_back();
  return msg;
}

}  // namespace

int main(int argc, char** argv) {
  // A file size limit (ulimit -f) would kill the process mid-write with
  // SIGXFSZ; ignored, the write fails with EFBIG and the command reports it
  // and cleans up (pack removes its temporary directory).
  std::signal(SIGXFSZ, SIG_IGN);
#if defined(__GLIBC__)
  // Freed memory stays in the heap for the next allocation of its size
  // instead of going back to the OS. By default glibc serves blocks over
  // 128 KB-32 MB by mmap and unmaps them when freed (and trims the heap's
  // top): every KV cache that grows, every request's state, came back as
  // fresh pages, each faulted in and zeroed again (page faults are dear
  // under a hypervisor: the KV appends of an attention layer took 41 us at
  // 8 sequences on the CPU box, 11 at one; bench/NOTES.md, "Session 24").
  // Blocks over 64 MB still use mmap, and the heap keeps at most 256 MB
  // free at its top.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
  CLI::App app{"flashmoe: inference for Qwen3.5 / Qwen3-Next hybrid-attention MoE models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "flashmoe 0.1.0");
  for (auto& setup : flashmoe::cli::registered_commands()) setup(app);
  std::string commands;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App* s) { return !s->get_name().empty(); }))
    commands += (commands.empty() ? "" : ", ") + sub->get_name();
  if (argc < 2) return user_error("no command given (commands: " + commands + ")");
  if (argv[1][0] != '-' && app.get_subcommands([&](CLI::App* s) { return s->check_name(argv[1]); }).empty())
    return user_error(std::string("unknown command '") + argv[1] + "' (commands: " + commands + ")");
  // FLASHMOE_CPU_LEVEL is checked before any kernel runs (possibly on a
  // worker thread, where a throw could not reach this handler).
  try {
    flashmoe::cpu_level();
  } catch (const flashmoe::Error& e) {
    return user_error(e.what());
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);  // --help, --help-all, --version: printed, exit 0
  } catch (const CLI::ParseError& e) {
    if (app.get_subcommands().empty() && dynamic_cast<const CLI::RequiredError*>(&e))
      return user_error("no command given (commands: " + commands + ")");
    return user_error(parse_error_message(e));
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
