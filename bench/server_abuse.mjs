// The abuse run of docs/server.md, in two roles that run as separate
// processes (bench/server_abuse.sh places them on the cores):
//   node bench/server_abuse.mjs client PORT SECONDS   a well-behaved client
//     (an 8-token completion, then /health, in a loop); prints its latencies
//   node bench/server_abuse.mjs attack PORT SECONDS   the hostile clients:
//     a slowloris (200 connections trickling a header byte each second),
//     header floods (10,000 header lines per request), a chunked upload of
//     100 MB, and bursts of 500 connections at once; prints what the server
//     did with them
// Separate processes, so that the attackers' own event loop does not delay
// the well-behaved client's measurements. Node 20, no packages.
import net from "node:net";

const role = process.argv[2];
const port = Number(process.argv[3]);
const seconds = Number(process.argv[4] || 20);
const host = "127.0.0.1";

function pct(xs, p) {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}
const ms = (x) => x.toFixed(1);

// One raw HTTP exchange; resolves with {status, ms} (status 0: no answer).
function exchange(bytes, { timeout = 60000 } = {}) {
  return new Promise((resolve) => {
    const t0 = performance.now();
    const s = net.connect(port, host);
    let got = "";
    const done = (st) => { s.destroy(); resolve({ status: st, ms: performance.now() - t0, got }); };
    s.setTimeout(timeout, () => done(0));
    s.on("connect", () => s.write(bytes));
    s.on("data", (d) => {
      got += d.toString("latin1");
      const m = /^HTTP\/1\.1 (\d+)/.exec(got);
      const end = got.indexOf("\r\n\r\n");
      if (m && end >= 0) {
        const len = /content-length: (\d+)/i.exec(got);
        if (len && got.length >= end + 4 + Number(len[1])) done(Number(m[1]));
      }
    });
    s.on("error", () => done(0));
    s.on("close", () => { const m = /^HTTP\/1\.1 (\d+)/.exec(got); done(m ? Number(m[1]) : 0); });
  });
}

const completion = JSON.stringify({ prompt: "def add(a, b):", max_tokens: 8, temperature: 0 });
const completionReq = `POST /v1/completions HTTP/1.1\r\nHost: ${host}\r\nContent-Type: application/json\r\n` +
  `Content-Length: ${Buffer.byteLength(completion)}\r\nConnection: close\r\n\r\n${completion}`;
const healthReq = `GET /health HTTP/1.1\r\nHost: ${host}\r\nConnection: close\r\n\r\n`;

// The well-behaved client: a completion, then /health, in a loop.
async function wellBehaved(until) {
  const comp = [], health = [];
  let failures = 0;
  while (performance.now() < until) {
    const c = await exchange(completionReq);
    if (c.status === 200) comp.push(c.ms); else failures++;
    const h = await exchange(healthReq);
    if (h.status === 200) health.push(h.ms); else failures++;
  }
  return { comp, health, failures };
}

function slowloris(n, until, stats) {
  for (let i = 0; i < n; i++) {
    const open = () => {
      if (performance.now() >= until) return;
      const s = net.connect(port, host);
      const t0 = performance.now();
      s.on("connect", () => s.write(`POST /v1/completions HTTP/1.1\r\nHost: ${host}\r\nX-Slow: `));
      const tick = setInterval(() => s.writable && s.write("a"), 1000);
      s.on("data", () => {});
      const end = () => {
        clearInterval(tick);
        stats.closedAfter.push(performance.now() - t0);
        s.destroy();
        open();  // and come back
      };
      s.on("close", end);
      s.on("error", () => {});
    };
    open();
  }
}

async function headerFlood(until, stats) {
  let req = `GET /v1/models HTTP/1.1\r\nHost: ${host}\r\n`;
  for (let i = 0; i < 10000; i++) req += `X-Pad-${i}: ${"v".repeat(8)}\r\n`;
  req += "\r\n";
  while (performance.now() < until) {
    const r = await exchange(req);
    stats.statuses[r.status] = (stats.statuses[r.status] || 0) + 1;
  }
}

function chunkedUpload(totalBytes, stats) {
  return new Promise((resolve) => {
    const s = net.connect(port, host);
    const chunk = Buffer.alloc(1 << 16, 120);
    const line = Buffer.from((chunk.length).toString(16) + "\r\n");
    let sent = 0, got = "";
    const t0 = performance.now();
    const pump = () => {
      while (sent < totalBytes) {
        sent += chunk.length;
        if (!s.write(Buffer.concat([line, chunk, Buffer.from("\r\n")]))) return s.once("drain", pump);
      }
      s.write("0\r\n\r\n");
    };
    s.on("connect", () => {
      s.write(`POST /v1/completions HTTP/1.1\r\nHost: ${host}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n`);
      pump();
    });
    s.on("data", (d) => { got += d.toString("latin1"); });
    const end = () => {
      const m = /^HTTP\/1\.1 (\d+)/.exec(got);
      stats.uploads.push({ status: m ? Number(m[1]) : 0, sentMiB: +(sent / 2 ** 20).toFixed(1), ms: performance.now() - t0 });
      s.destroy();
      resolve();
    };
    s.on("close", end);
    s.on("error", () => {});
  });
}

async function burst(n, stats) {
  const t0 = performance.now();
  const rs = await Promise.all(Array.from({ length: n }, () => exchange(healthReq, { timeout: 20000 })));
  stats.bursts.push({ ok: rs.filter((r) => r.status === 200).length, n, p99: pct(rs.map((r) => r.ms), 99), ms: performance.now() - t0 });
}

function report(name, r) {
  console.log(`${name}: completions n=${r.comp.length} p50 ${ms(pct(r.comp, 50))} ms p99 ${ms(pct(r.comp, 99))} ms; ` +
    `/health n=${r.health.length} p50 ${ms(pct(r.health, 50))} ms p99 ${ms(pct(r.health, 99))} ms; failures ${r.failures}`);
  console.log(`p99 ms: completions ${ms(pct(r.comp, 99))} health ${ms(pct(r.health, 99))}`);
}

if (role === "client") {
  report(process.argv[5] || "client", await wellBehaved(performance.now() + seconds * 1000));
} else if (role === "attack") {
  const until = performance.now() + seconds * 1000;
  const stats = { closedAfter: [], statuses: {}, uploads: [], bursts: [] };
  slowloris(200, until, stats);
  await Promise.all([headerFlood(until, stats), chunkedUpload(100 * 2 ** 20, stats),
    (async () => { while (performance.now() < until) { await burst(500, stats); await new Promise((r) => setTimeout(r, 1000)); } })()]);
  console.log(`slowloris: ${stats.closedAfter.length} connections dropped by the server, after ` +
    `${ms(pct(stats.closedAfter, 50) / 1000)} s median (${ms(Math.min(...stats.closedAfter) / 1000)}-${ms(Math.max(...stats.closedAfter) / 1000)} s)`);
  console.log(`header floods (10,000 lines): statuses ${JSON.stringify(stats.statuses)}`);
  console.log(`chunked 100 MiB upload: ${JSON.stringify(stats.uploads)}`);
  console.log(`500-connection bursts: ${JSON.stringify(stats.bursts.map((b) => `${b.ok}/${b.n} ok, p99 ${ms(b.p99)} ms`))}`);
} else {
  console.error("usage: node bench/server_abuse.mjs client|attack PORT SECONDS");
  process.exit(2);
}
process.exit(0);
