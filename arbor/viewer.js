const DATA = JSON.parse(document.getElementById('arbor-data').textContent);
const tip = document.getElementById('tip');
const fmt = (x, signed) => x === null || x === undefined ? '–'
  : (signed && x >= 0 ? '+' : '') + x.toFixed(2);
function hit(target) {
  const g = target.closest && target.closest('[data-node]');
  if (!g) return null;
  const t = g.closest('section').dataset.tree;
  return {g: g, tree: t, id: g.dataset.node, node: DATA[t].nodes[g.dataset.node]};
}
function summary(h) {
  const n = h.node;
  if (n.parent === null) return 'prompt · ' + n.tokens + ' tokens';
  let s = 'node ' + h.id + ' · depth ' + n.depth + ' · tokens ' + n.start + '–'
    + (n.start + n.tokens) + ' (' + n.tokens + ') · leaves below ' + n.leaves;
  if (h.g.dataset.leaf !== undefined) s += '\nleaf ' + h.g.dataset.leaf + ' · reward '
    + fmt(n.reward) + ' · advantage ' + fmt(n.advantage, true) + ' · finish ' + (n.finish || '–');
  else s += '\ncolour value (mean over leaves below) ' + fmt(n.value);
  if (n.mean_logprob !== null) s += ' · mean logprob ' + fmt(n.mean_logprob);
  if (n.weights) s += ' · weights ' + n.weights;
  return s;
}
document.addEventListener('mouseover', e => {
  const h = hit(e.target);
  if (!h) { tip.style.display = 'none'; return; }
  const text = h.node.text.length > 300 ? h.node.text.slice(0, 300) + '…' : h.node.text;
  tip.textContent = summary(h) + '\n\n' + text;
  tip.style.display = 'block';
});
document.addEventListener('mousemove', e => {
  tip.style.left = Math.min(e.clientX + 14, window.innerWidth - 440) + 'px';
  tip.style.top = (e.clientY + 14) + 'px';
});
document.addEventListener('click', e => {
  const h = hit(e.target);
  if (!h) return;
  const section = h.g.closest('section');
  section.querySelectorAll('.selected').forEach(el => el.classList.remove('selected'));
  h.g.classList.add('selected');
  const nodes = DATA[h.tree].nodes, path = [];
  for (let id = h.id; id !== null; id = nodes[id].parent) path.unshift(String(id));
  const box = section.querySelector('.details');
  box.textContent = '';
  const head = document.createElement('div');
  head.className = 'head';
  head.textContent = summary(h);
  box.appendChild(head);
  path.forEach(id => {
    const span = document.createElement('span');
    span.className = nodes[id].parent === null ? 'prompt' : (id === h.id ? 'here' : '');
    span.textContent = nodes[id].text + (nodes[id].parent === null ? '\n' : DATA[h.tree].separator);
    box.appendChild(span);
  });
});
const select = document.getElementById('tree-select');
if (select) select.addEventListener('change', () => {
  document.querySelectorAll('section.tree').forEach(s => { s.hidden = s.dataset.tree !== select.value; });
});
