// report.js: draws the `moetron report` page in the browser from the run's data (the JSON in
// <script id="run-data">, built by src/report/run_data.cpp) with Chart.js and its matrix chart, which the page
// inlines before this script. Not the data preparation (C++) and not a chart library: every chart is Chart.js.
// With "#check" in the address, the page also writes what each chart drew into a pre element "check" (read by
// tests/report/check_report_page.py).
(function () {
  'use strict';
  const data = JSON.parse(document.getElementById('run-data').textContent);
  const main = document.getElementById('report');
  const charts = {};
  const COLORS = {
    loss: '#1f77b4', val: '#d62728', aux: '#9467bd', lr: '#2ca02c', gnorm: '#ff7f0e', tps: '#17becf',
    mfu: '#8c564b', mem: '#4e79a7', compute: '#59a14f', comm: '#e15759', idle: '#bab0ac'
  };
  Chart.defaults.animation = false;
  Chart.defaults.maintainAspectRatio = false;
  Chart.defaults.font.size = 11;

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') e.className = v; else e.setAttribute(k, v);
    }
    for (const k of kids) e.append(k);
    return e;
  }
  function fmt(v) {
    if (typeof v !== 'number') return v === null || v === undefined ? '' : String(v);
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(3) : v.toPrecision(4);
  }
  function section(title, note) {
    const s = el('section', {}, el('h2', {}, title));
    if (note) s.append(el('p', { class: 'note' }, note));
    main.append(s);
    return s;
  }
  function card(parent, id, title, note, tall) {
    const c = el('div', { class: 'card' + (tall ? ' tall' : '') }, el('h3', {}, title));
    if (note) c.append(el('p', { class: 'note' }, note));
    const canvas = el('canvas', { id: id });
    c.append(el('div', { class: 'plot' }, canvas));
    parent.append(c);
    return canvas;
  }
  function xy(xs, ys) {
    const pts = [];
    for (let i = 0; i < xs.length; i++) pts.push({ x: xs[i], y: ys[i] === null ? NaN : ys[i] });
    return pts;
  }
  function line(label, xs, ys, color, extra) {
    return Object.assign({
      label: label, data: xy(xs, ys), borderColor: color, backgroundColor: color, borderWidth: 1.5,
      pointRadius: xs.length > 60 ? 0 : 2, spanGaps: true
    }, extra || {});
  }
  function lineChart(canvas, datasets, yTitle, more) {
    const scales = {
      x: { type: 'linear', title: { display: true, text: 'step' } },
      y: { title: { display: true, text: yTitle } }
    };
    Object.assign(scales, (more && more.scales) || {});
    charts[canvas.id] = new Chart(canvas, {
      type: 'line', data: { datasets: datasets },
      options: { scales: scales, plugins: { legend: { display: datasets.length > 1 } },
                 interaction: { mode: 'nearest', axis: 'x', intersect: false } }
    });
  }
  function hasNumbers(a) { return a.some(v => v !== null); }

  // A sequential colour scale (dark blue - green - yellow), v in [lo, hi].
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function colour(v, lo, hi) {
    const t = Math.max(0, Math.min(1, hi > lo ? (v - lo) / (hi - lo) : 0)) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i;
    const c = STOPS[i].map((a, k) => Math.round(a + f * (STOPS[i + 1][k] - a)));
    return 'rgb(' + c.join(',') + ')';
  }
  function legendBar(parent, lo, hi, text) {
    const g = STOPS.map(s => 'rgb(' + s.join(',') + ')').join(',');
    parent.append(el('div', { class: 'scale' }, el('span', {}, fmt(lo)),
      el('span', { class: 'bar', style: 'background: linear-gradient(to right,' + g + ')' }),
      el('span', {}, fmt(hi)), el('span', { class: 'note' }, ' ' + text)));
  }
  // cells: [{x: column, y: row, v}] over nx columns (labels xl) and ny rows (labels yl).
  const cell = size => Math.max(1, size > 8 ? size - 1 : size + 0.5);
  function heatmap(canvas, cells, nx, ny, xl, yl, xTitle, yTitle, lo, hi, tip) {
    // One tick per row or column (at most about 20 of them), labelled with its step, layer or expert.
    const axis = (n, labels, title, reverse) => ({
      type: 'linear', min: -0.5, max: n - 0.5, reverse: reverse, offset: false, grid: { display: false },
      title: { display: true, text: title },
      afterBuildTicks: scale => {
        const every = Math.ceil(n / 20), t = [];
        for (let i = 0; i < n; i += every) t.push({ value: i });
        scale.ticks = t;
      },
      ticks: { autoSkip: false, callback: v => (Number.isInteger(v) && v >= 0 && v < n ? labels[v] : '') }
    });
    charts[canvas.id] = new Chart(canvas, {
      type: 'matrix',
      data: { datasets: [{
        label: tip, data: cells,
        backgroundColor: ctx => colour(ctx.raw.v, lo, hi),
        // A 1-pixel gap between wide cells; narrow ones overlap by half a pixel (no seams between them).
        width: ({ chart }) => cell((chart.chartArea || {}).width / nx),
        height: ({ chart }) => cell((chart.chartArea || {}).height / ny)
      }] },
      options: {
        scales: { x: axis(nx, xl, xTitle, false), y: axis(ny, yl, yTitle, true) },
        plugins: { legend: { display: false }, tooltip: { callbacks: {
          title: items => xTitle + ' ' + xl[items[0].raw.x] + ', ' + yTitle + ' ' + yl[items[0].raw.y],
          label: item => tip + ': ' + fmt(item.raw.v) } } }
      }
    });
  }

  // ---- header ----
  const n = data.records;
  const last = k => { const a = data[k]; for (let i = a.length - 1; i >= 0; i--) if (a[i] !== null) return a[i]; return null; };
  main.append(el('h1', {}, 'moetron run report'));
  main.append(el('p', { class: 'sub' }, data.title + ': ' + n + ' log records, steps ' + data.steps[0] + '..' +
    data.steps[data.steps.length - 1] + '; final loss ' + fmt(last('loss')) +
    (data.val.loss.length ? ', final validation loss ' + fmt(data.val.loss[data.val.loss.length - 1]) : '') +
    (last('tokens_per_s') !== null ? ', last ' + fmt(last('tokens_per_s')) + ' tokens/s' : '') +
    (last('mfu_pct') !== null ? ', MFU ' + fmt(last('mfu_pct')) + '%' : '')));

  // ---- training curves ----
  const tr = el('div', { class: 'grid' });
  section('Training').append(tr);
  const lossSets = [line('loss', data.steps, data.loss, COLORS.loss)];
  if (data.val.steps.length)
    lossSets.push(line('validation loss', data.val.steps, data.val.loss, COLORS.val,
                       { pointRadius: 3, showLine: data.val.steps.length > 1 }));
  const lossMore = {};
  if (hasNumbers(data.aux_loss)) {
    lossSets.push(line('aux loss (right axis)', data.steps, data.aux_loss, COLORS.aux, { yAxisID: 'y2', borderDash: [4, 3] }));
    lossMore.scales = { y2: { position: 'right', grid: { drawOnChartArea: false }, title: { display: true, text: 'aux loss' } } };
  }
  lineChart(card(tr, 'chart-loss', 'Loss', 'training cross-entropy per log step' +
            (data.val.steps.length ? ', validation loss where measured' : '; no validation loss in this run')),
            lossSets, 'loss (nats/token)', lossMore);
  const curves = [
    ['chart-lr', 'Learning rate', 'lr', 'learning rate', COLORS.lr],
    ['chart-gnorm', 'Gradient norm', 'grad_norm', 'global L2 norm (before clipping)', COLORS.gnorm],
    ['chart-tps', 'Throughput', 'tokens_per_s', 'tokens/s (mean over the log window)', COLORS.tps],
    ['chart-mfu', 'MFU', 'mfu_pct', 'MFU (%)', COLORS.mfu]
  ];
  const notes = { mfu_pct: 'model FLOPs per second over the peak per rank (measured, or [metrics] peak_tflops)' };
  for (const [id, title, key, yTitle, color] of curves) {
    if (!hasNumbers(data[key])) { tr.append(el('div', { class: 'card' }, el('h3', {}, title), el('p', { class: 'note' }, 'not in metrics.jsonl'))); continue; }
    lineChart(card(tr, id, title, notes[key]), [line(title, data.steps, data[key], color)], yTitle);
  }
  if (data.memory) {
    const cats = Object.entries(data.memory.by_category).filter(([, b]) => b > 0);
    const c = card(tr, 'chart-memory', 'Peak memory by category',
                   'rank 0, peak up to step ' + data.memory.step + ', total peak ' + fmt(data.memory.total_peak / 1048576) + ' MiB');
    charts[c.id] = new Chart(c, {
      type: 'bar',
      data: { labels: cats.map(([k]) => k),
              datasets: [{ label: 'peak MiB', data: cats.map(([, b]) => b / 1048576), backgroundColor: COLORS.mem }] },
      options: { indexAxis: 'y', plugins: { legend: { display: false } },
                 scales: { x: { title: { display: true, text: 'MiB' } } } }
    });
  } else {
    tr.append(el('div', { class: 'card' }, el('h3', {}, 'Peak memory by category'), el('p', { class: 'note' }, 'not in metrics.jsonl')));
  }

  // ---- expert load ----
  const ex = data.experts;
  if (!ex) {
    section('Expert load', 'no expert_counts in metrics.jsonl (a dense model, or a run written before they were logged)');
  } else {
    const s = section('Expert load', 'tokens routed to each expert at each logged step over the balanced share ' +
      '(1 = balanced), every MoE layer of the model' + (ex.bin > 1 ? '; experts summed in bins of ' + ex.bin + ' (metrics.jsonl cap)' : '') +
      (ex.stride > 1 ? '; one logged step in ' + ex.stride + ' of ' + ex.records : ''));
    const g = el('div', { class: 'grid wide' });
    s.append(g);
    const xl = ex.steps.map(String), yl = ex.layers.map(String);
    let hi = 1;
    const cells = [];
    ex.imbalance.forEach((row, l) => row.forEach((v, k) => { cells.push({ x: k, y: l, v: v }); hi = Math.max(hi, v); }));
    const c1 = card(g, 'chart-expert-layers', 'Imbalance per layer', 'most loaded expert over the balanced share', true);
    heatmap(c1, cells, xl.length, yl.length, xl, yl, 'step', 'layer', 1, hi, 'max / balanced');
    legendBar(c1.parentNode.parentNode, 1, hi, 'max load / balanced load');

    if (ex.dead) {  // experts with no token over each record's logging window
      let hiD = 1;
      const dcells = [];
      ex.dead.forEach((row, l) => row.forEach((v, k) => { if (v !== null) { dcells.push({ x: k, y: l, v: v }); hiD = Math.max(hiD, v); } }));
      const cd = card(g, 'chart-expert-dead', 'Dead experts per layer',
                      'experts that received no token in the steps since the previous logged step', true);
      heatmap(cd, dcells, xl.length, yl.length, xl, yl, 'step', 'layer', 0, hiD, 'dead experts');
      legendBar(cd.parentNode.parentNode, 0, hiD, 'dead experts (of ' + ex.experts + ')');
    }

    const cols = ex.share[0][0].length;
    const el2 = card(g, 'chart-expert-detail', 'Load per expert', null, true);
    const pick = el('select', { id: 'expert-layer' });
    ex.layers.forEach((L, i) => pick.append(el('option', { value: String(i) }, 'layer ' + L)));
    el2.parentNode.parentNode.insertBefore(el('label', {}, 'MoE layer ', pick), el2.parentNode);
    const expertLabels = [];
    for (let k = 0; k < cols; k++)
      expertLabels.push(ex.bin > 1 ? (k * ex.bin) + '-' + (Math.min(ex.experts, (k + 1) * ex.bin) - 1) : String(k));
    let hi2 = 1;
    ex.share.forEach(layer => layer.forEach(row => row.forEach(v => { hi2 = Math.max(hi2, v); })));
    const detail = l => {
      const cs = [];
      ex.share[l].forEach((row, k) => row.forEach((v, e) => cs.push({ x: k, y: e, v: v })));
      return cs;
    };
    heatmap(el2, detail(0), xl.length, cols, xl, expertLabels, 'step', 'expert', 0, hi2, 'load / balanced');
    legendBar(el2.parentNode.parentNode, 0, hi2, 'load / balanced load');
    pick.addEventListener('change', () => {
      const ch = charts['chart-expert-detail'];
      ch.data.datasets[0].data = detail(Number(pick.value));
      ch.update();
    });
  }

  // ---- trace analysis ----
  const an = data.analysis;
  if (!an) {
    section('Trace analysis', 'no trace analysis (profile the run, then `moetron trace analyze DIR --json > RUN_DIR/analysis.json`, ' +
            'or pass --analysis FILE)');
  } else {
    const s = section('Trace analysis', (data.sources && data.sources.analysis ? data.sources.analysis + '; ' : '') +
      (an.straggler_rank === null ? 'no straggler named' : 'straggler: rank ' + an.straggler_rank + ' (the rank the others wait for most)'));
    const g = el('div', { class: 'grid' });
    s.append(g);
    const c = card(g, 'chart-breakdown', 'Step time per rank', 'compute, exposed communication and idle add up to the step time');
    const parts = [['compute', 'compute_s', COLORS.compute], ['exposed communication', 'exposed_comm_s', COLORS.comm], ['idle', 'idle_s', COLORS.idle]];
    charts[c.id] = new Chart(c, {
      type: 'bar',
      data: { labels: an.ranks.map(r => 'rank ' + r.rank),
              datasets: parts.map(([label, key, color]) => ({ label: label, data: an.ranks.map(r => r[key]), backgroundColor: color })) },
      options: { scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: 'seconds per step' } } } }
    });
    for (const [key, title] of [['top_kernels', 'Top kernels'], ['collectives', 'Collectives']]) {
      const rows = an[key];
      const box = el('div', { class: 'card table' }, el('h3', {}, title + ' (' + rows.length + ' of ' + an[key + '_total'] + ')'));
      if (!rows.length) box.append(el('p', { class: 'note' }, 'none'));
      else {
        const keys = [];  // every key of the rows, those holding text (names) first
        rows.forEach(r => Object.keys(r).forEach(k => { if (!keys.includes(k)) keys.push(k); }));
        const text = k => rows.some(r => typeof r[k] === 'string');
        keys.sort((p, q) => text(q) - text(p));
        const t = el('table', { id: 'table-' + key }, el('tr', {}, ...keys.map(k => el('th', {}, k))));
        rows.forEach(r => t.append(el('tr', {}, ...keys.map(k => el('td', {},
          typeof r[k] === 'object' && r[k] !== null ? JSON.stringify(r[k]) : fmt(r[k]))))));
        box.append(t);
      }
      g.append(box);
    }
  }

  // ---- config ----
  const cs = section('Config', data.config === null ? 'no config.toml in the run directory (written by moetron train from this version on)'
                                                    : (data.sources ? data.sources.config : 'config.toml'));
  if (data.config !== null) cs.append(el('pre', { id: 'config' }, data.config));

  // ---- "#check": what each chart drew, from its canvas pixels ----
  if (location.hash === '#check') {
    const parse = c => { const m = /^#(..)(..)(..)$/.exec(c); return m ? m.slice(1).map(h => parseInt(h, 16)) : null; };
    const out = {};
    for (const [id, ch] of Object.entries(charts)) {
      const cv = ch.canvas, px = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
      const ratio = cv.width / ch.width, a = ch.chartArea;
      const x0 = Math.floor(a.left * ratio), x1 = Math.ceil(a.right * ratio), y0 = Math.floor(a.top * ratio), y1 = Math.ceil(a.bottom * ratio);
      let painted = 0, inArea = 0;
      for (let y = y0; y < y1; y++) for (let x = x0; x < x1; x++) { inArea++; if (px[4 * (y * cv.width + x) + 3] > 0) painted++; }
      const sets = ch.data.datasets.map((d, k) => {
        const meta = ch.getDatasetMeta(k), col = ch.config.type === 'bar' ? d.backgroundColor : d.borderColor;
        const rgb = typeof col === 'string' ? parse(col) : null;
        let colourPx = 0;
        if (rgb) for (let y = y0; y < y1; y++) for (let x = x0; x < x1; x++) {  // the plot area only (not the legend)
          const i = 4 * (y * cv.width + x);
          if (px[i + 3] > 200 && Math.abs(px[i] - rgb[0]) < 12 && Math.abs(px[i + 1] - rgb[1]) < 12 && Math.abs(px[i + 2] - rgb[2]) < 12) colourPx++;
        }
        return { label: d.label, elements: meta.data.length,
                 finite: meta.data.filter(e => Number.isFinite(e.x) && Number.isFinite(e.y)).length,
                 colour_px: rgb ? colourPx : null };
      });
      out[id] = { type: ch.config.type, area_w: x1 - x0, area_px: inArea, painted_px: painted, datasets: sets };
    }
    main.append(el('pre', { id: 'check' }, JSON.stringify(out)));
  }
})();
