// Each subcommand lives in its own cli/cmd_*.cpp and registers itself here
// with a static Registrar, so adding a command never touches main.cpp.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace flashmoe::cli {

// setup() adds the subcommand (its options and callback) to the app.
using CommandSetup = std::function<void(CLI::App& app)>;

// `order` places the command in --help and must differ between commands:
// equal orders would follow static initialisation order, which the unity
// build of src/cli (CMakeLists.txt) does not keep.
struct Registrar {
  Registrar(int order, CommandSetup setup);
};

// The setups in registration order (sorted by `order`, for a stable --help).
std::vector<CommandSetup> registered_commands();

}  // namespace flashmoe::cli
