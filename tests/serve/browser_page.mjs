// The compare page in a real headless browser (Debian's chromium) through the DevTools protocol: load
// BASE/?auto=1 (the page submits its form), wait for the results, check the DOM (one image and its figures per mode,
// one timeline bar per step) and save a screenshot. Usage: node --experimental-websocket browser_page.mjs BASE OUT.png
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import assert from "node:assert/strict";

const [base, shot] = process.argv.slice(2);
const profile = mkdtempSync(join(tmpdir(), "anchor-chromium-"));
const browser = spawn("chromium", ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
  "--no-first-run", "--remote-debugging-port=0", `--user-data-dir=${profile}`, "--window-size=1100,820",
  "about:blank"], { stdio: ["ignore", "ignore", "pipe"] });
const deadline = setTimeout(() => { console.error("browser test: timed out"); cleanup(); process.exit(1); }, 240000);
function cleanup() { try { browser.kill("SIGKILL"); } catch {} try { rmSync(profile, { recursive: true, force: true }); } catch {} }

const wsBrowser = await new Promise((resolve, reject) => {
  let err = "";
  browser.stderr.on("data", (d) => {
    err += d;
    const m = err.match(/DevTools listening on (ws:\/\/[^\s]+)/);
    if (m) resolve(m[1]);
  });
  browser.on("exit", (c) => reject(new Error("chromium exited " + c + ": " + err)));
});
const http = wsBrowser.replace(/^ws:\/\/([^/]+)\/.*$/, "http://$1");
const pages = await (await fetch(http + "/json/list")).json();
const page = pages.find((p) => p.type === "page");
const ws = new WebSocket(page.webSocketDebuggerUrl);
await new Promise((r) => ws.addEventListener("open", r));
let nextId = 1;
const pending = new Map();
ws.addEventListener("message", (ev) => {
  const msg = JSON.parse(ev.data);
  if (msg.id && pending.has(msg.id)) { pending.get(msg.id)(msg); pending.delete(msg.id); }
});
const send = (method, params = {}) => new Promise((resolve, reject) => {
  const id = nextId++;
  pending.set(id, (m) => (m.error ? reject(new Error(method + ": " + m.error.message)) : resolve(m.result)));
  ws.send(JSON.stringify({ id, method, params }));
});
const evaluate = async (expr) => (await send("Runtime.evaluate", { expression: expr, returnByValue: true })).result.value;

await send("Page.enable");
await send("Emulation.setDeviceMetricsOverride", { width: 1100, height: 820, deviceScaleFactor: 1, mobile: false });
await send("Page.navigate", { url: base + "/?auto=1" });
let status = "", sawProgress = false;
for (let i = 0; i < 2000; i++) {
  status = (await evaluate("document.getElementById('status') && document.getElementById('status').textContent")) || "";
  if (status.startsWith("running")) sawProgress = true;
  if (status === "done" || status.startsWith("error")) break;
  await new Promise((r) => setTimeout(r, 100));
}
assert.equal(status, "done", "page status: " + status);
const dom = await evaluate(`JSON.stringify([...document.querySelectorAll('#results .result')].map((r) => ({
  mode: r.querySelector('h2').textContent,
  img: r.querySelector('img').naturalWidth,
  figures: Object.fromEntries([...r.querySelectorAll('.figures tr')].map((tr) => [tr.cells[0].textContent, tr.cells[1].textContent])),
  bars: r.querySelectorAll('.timeline div').length,
  reused: r.querySelectorAll('.timeline .reuse').length })))`);
const results = JSON.parse(dom);
assert.equal(results.length, 3, dom);
for (const r of results) {
  assert.ok(r.img > 0, "image not decoded: " + dom);
  for (const k of ["wall", "speed-up", "full steps", "PSNR", "SSIM"]) assert.ok(r.figures[k], `${r.mode}: no ${k}`);
  assert.equal(r.bars, 20, dom);
}
assert.equal(results[0].figures["PSNR"], "inf");
assert.ok(results[1].reused > 0 && results[2].reused > 0, "cached modes reuse steps: " + dom);
const png = await send("Page.captureScreenshot", { format: "png" });
writeFileSync(shot, Buffer.from(png.data, "base64"));
console.log(`browser page: ok (${results.map((r) => `${r.mode} ${r.figures["speed-up"]} ${r.figures["PSNR"]}`).join("; ")}` +
            `; progress seen: ${sawProgress}); screenshot ${shot}`);
clearTimeout(deadline);
ws.close();
cleanup();
process.exit(0);
