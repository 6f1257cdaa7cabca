// The compare page: POST /anchor/v1/compare with the form's fields, /sdapi/v1/progress polled for the bar, every
// mode's image side by side with its figures and its per-step timeline (full vs reused, energy change).
"use strict";
const $ = (id) => document.getElementById(id);

async function loadSamplers() {
  try {
    const list = await (await fetch("/sdapi/v1/samplers")).json();
    $("sampler").innerHTML = "";
    for (const s of list) {
      const o = document.createElement("option");
      o.textContent = s.name;
      if (s.name === "DDIM") o.selected = true;
      $("sampler").appendChild(o);
    }
  } catch (e) { /* the default option stays */ }
}

function figure(table, name, value) {
  const tr = table.insertRow();
  tr.insertCell().textContent = name;
  const td = tr.insertCell();
  td.textContent = value;
  td.className = "value";
}

function render(report) {
  const box = $("results");
  box.innerHTML = "";
  for (const m of report.modes) {
    const div = document.createElement("div");
    div.className = "result";
    const h = document.createElement("h2");
    h.textContent = m.mode;
    div.appendChild(h);
    const img = document.createElement("img");
    img.src = "data:image/png;base64," + m.image;
    img.alt = m.mode;
    div.appendChild(img);
    const t = document.createElement("table");
    t.className = "figures";
    figure(t, "wall", m.wall_s.toFixed(3) + " s");
    figure(t, "speed-up", m.speedup_vs_first.toFixed(2) + "x");
    figure(t, "full steps", m.full_steps + "/" + m.total_steps);
    figure(t, "PSNR", typeof m.psnr_vs_first_db === "number" ? m.psnr_vs_first_db.toFixed(2) + " dB" : "inf");
    figure(t, "SSIM", m.ssim_vs_first === null ? "n/a" : m.ssim_vs_first.toFixed(4));
    div.appendChild(t);
    const tl = document.createElement("div");
    tl.className = "timeline";
    const maxE = Math.max(1e-9, ...m.steps.map((s) => s.energy_change));
    for (const s of m.steps) {
      const bar = document.createElement("div");
      bar.className = s.full ? "full" : "reuse";
      bar.style.height = Math.max(8, (100 * s.energy_change) / maxE) + "%";
      bar.title = `step ${s.step}: ${s.full ? "full" : "reused"}, energy change ${s.energy_change.toFixed(3)}`;
      tl.appendChild(bar);
    }
    div.appendChild(tl);
    box.appendChild(div);
  }
}

async function pollProgress(state) {
  while (state.running) {
    try {
      const p = await (await fetch("/sdapi/v1/progress")).json();
      const n = state.modes, st = p.state || {};
      const frac = st.sampling_steps ? ((st.job_no || 0) + st.sampling_step / st.sampling_steps) / n : 0;
      $("progress-bar").style.width = Math.min(100, 100 * frac) + "%";
      if (st.sampling_steps)
        $("status").textContent = `running: mode ${(st.job_no || 0) + 1}/${n}, step ${st.sampling_step}/${st.sampling_steps}` +
          (p.anchor ? ` (${p.anchor.step_full ? "full" : "reused"})` : "");
    } catch (e) { /* the next poll */ }
    await new Promise((r) => setTimeout(r, 150));
  }
}

async function submit(ev) {
  ev.preventDefault();
  const modes = $("modes").value.split(",").reduce((acc, m) => {
    m = m.trim();
    if (!m) return acc;
    if (m.includes("=") && !m.includes(":") && acc.length) acc[acc.length - 1] += "," + m; // branch=1 etc.
    else acc.push(m);
    return acc;
  }, []);
  const body = {
    prompt: $("prompt").value, negative_prompt: $("negative").value, seed: Number($("seed").value),
    steps: Number($("steps").value), sampler_name: $("sampler").value, modes,
  };
  const state = { running: true, modes: modes.length };
  $("run").disabled = true;
  $("status").textContent = "queued";
  $("status").className = "";
  $("progress-bar").style.width = "0";
  pollProgress(state);
  try {
    const r = await fetch("/anchor/v1/compare", { method: "POST", headers: { "Content-Type": "application/json" },
                                                   body: JSON.stringify(body) });
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : "HTTP " + r.status);
    render(j);
    $("progress-bar").style.width = "100%";
    $("status").textContent = "done";
  } catch (e) {
    $("status").textContent = "error: " + e.message;
    $("status").className = "error";
  } finally {
    state.running = false;
    $("run").disabled = false;
  }
}

$("form").addEventListener("submit", submit);
loadSamplers();
// ?auto=1 submits at once (the headless browser test).
if (new URLSearchParams(location.search).get("auto") === "1") window.addEventListener("load", () => $("run").click());
