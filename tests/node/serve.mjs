// Starts and stops the `flashmoe serve` child the npm client tests talk to.
import { spawn, spawnSync } from "node:child_process";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// `flashmoe serve` with `args` on a free port (a random one, tried again
// when taken), answered /health: { proc, port }.
export async function startServer(bin, args) {
  for (let attempt = 0; attempt < 8; attempt++) {
    const port = 20000 + Math.floor(Math.random() * 40000);
    const proc = spawn(bin, ["serve", ...args, "--port", String(port)], { stdio: ["ignore", "inherit", "pipe"] });
    let log = "";
    let exited = false;
    proc.stderr.on("data", (d) => { log += d; process.stderr.write(d); });
    proc.on("exit", () => { exited = true; });
    const deadline = Date.now() + 60000;
    while (Date.now() < deadline && !exited) {
      if (log.includes("flashmoe serve: model")) {
        try {
          const r = await fetch(`http://127.0.0.1:${port}/health`);
          if (r.ok) return { proc, port };
        } catch {}
      }
      await sleep(100);
    }
    if (!exited) proc.kill("SIGKILL");
  }
  throw new Error("flashmoe serve did not start");
}

// SIGTERM, then the exit. Graceful shutdown is tested by
// ServerHardening.*; here a server still running 20 s after SIGTERM has its
// threads' stacks printed (gdb, when installed) for the log and is killed,
// so the client checks above decide the result. (A past shutdown deadlock
// was found this way: docs/server.md, "Shutdown".)
export async function stopServer(proc) {
  const exited = new Promise((r) => (proc.exitCode !== null || proc.signalCode !== null ? r(true) : proc.on("exit", () => r(true))));
  proc.kill("SIGTERM");
  if (await Promise.race([exited, sleep(20000).then(() => false)])) return;
  console.log(`# flashmoe serve (pid ${proc.pid}) still running 20 s after SIGTERM; its threads:`);
  const gdb = spawnSync("gdb", ["-p", String(proc.pid), "-batch", "-ex", "thread apply all bt"], { encoding: "utf8" });
  console.log(gdb.error ? "# (gdb is not installed)" : gdb.stdout.split("\n").map((l) => "# " + l).join("\n"));
  proc.kill("SIGKILL");
  await exited;
}

// Runs each { name, fn } in order (TAP-like lines: a failure does not stop
// the rest), stops the server, and exits non-zero if any failed.
export async function runTests(tests, proc) {
  let passed = 0, failed = 0;
  for (const t of tests) {
    try {
      await t.fn();
      passed++;
      console.log(`ok - ${t.name}`);
    } catch (e) {
      failed++;
      console.log(`not ok - ${t.name}: ${e.stack ?? e}`);
    }
  }
  await stopServer(proc);
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}
