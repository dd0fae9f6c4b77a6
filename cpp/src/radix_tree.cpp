#include "kvchat/radix_tree.h"

#include <algorithm>

namespace kvchat {

// An edge label (the tokens leading into this node) and the keys whose
// sequences pass through it (`through`) or end exactly here (`ends`).
struct TokenRadixTree::Node {
  std::vector<int64_t> label;
  std::map<int64_t, std::unique_ptr<Node>> children;  // by first token of the child's label
  std::set<std::string> through;
  std::set<std::string> ends;
};

namespace {

const std::string* first_accepted(const std::set<std::string>& keys,
                                  const TokenRadixTree::Accept& accept) {
  for (const auto& key : keys) {
    if (!accept || accept(key)) return &key;
  }
  return nullptr;
}

}  // namespace

TokenRadixTree::TokenRadixTree() : root_(std::make_unique<Node>()) {}
TokenRadixTree::~TokenRadixTree() = default;
TokenRadixTree::TokenRadixTree(TokenRadixTree&&) noexcept = default;
TokenRadixTree& TokenRadixTree::operator=(TokenRadixTree&&) noexcept = default;

void TokenRadixTree::insert(const std::string& key, std::vector<int64_t> ids) {
  erase(key);
  Node* node = root_.get();
  node->through.insert(key);
  size_t pos = 0;
  while (pos < ids.size()) {
    auto it = node->children.find(ids[pos]);
    if (it == node->children.end()) {
      auto leaf = std::make_unique<Node>();
      leaf->label.assign(ids.begin() + static_cast<std::ptrdiff_t>(pos), ids.end());
      leaf->through.insert(key);
      node = (node->children[ids[pos]] = std::move(leaf)).get();
      pos = ids.size();
      break;
    }
    Node* child = it->second.get();
    size_t m = 0;
    while (m < child->label.size() && pos + m < ids.size() && child->label[m] == ids[pos + m]) ++m;
    if (m < child->label.size()) {
      // Split the edge at m: a new middle node takes the shared part.
      auto middle = std::make_unique<Node>();
      middle->label.assign(child->label.begin(),
                           child->label.begin() + static_cast<std::ptrdiff_t>(m));
      middle->through = child->through;
      child->label.erase(child->label.begin(),
                         child->label.begin() + static_cast<std::ptrdiff_t>(m));
      const int64_t child_first = child->label.front();
      middle->children[child_first] = std::move(it->second);
      it->second = std::move(middle);
      child = it->second.get();
    }
    child->through.insert(key);
    node = child;
    pos += m;
  }
  node->ends.insert(key);
  sequences_[key] = std::move(ids);
}

void TokenRadixTree::erase(const std::string& key) {
  auto found = sequences_.find(key);
  if (found == sequences_.end()) return;
  const std::vector<int64_t>& ids = found->second;
  Node* node = root_.get();
  node->through.erase(key);
  size_t pos = 0;
  while (pos < ids.size()) {
    auto it = node->children.find(ids[pos]);
    Node* child = it->second.get();
    child->through.erase(key);
    pos += child->label.size();
    if (child->through.empty()) {  // nobody else passes here: drop the branch
      node->children.erase(it);
      sequences_.erase(found);
      return;
    }
    node = child;
  }
  node->ends.erase(key);
  sequences_.erase(found);
}

bool TokenRadixTree::contains(const std::string& key) const { return sequences_.count(key) > 0; }

TokenRadixTree::Match TokenRadixTree::longest_common_prefix(const int64_t* prompt, int64_t n,
                                                            const Accept& accept) const {
  Match best;
  const Node* node = root_.get();
  if (const auto* key = first_accepted(node->through, accept)) best.key = *key;
  int64_t depth = 0;
  while (depth < n) {
    auto it = node->children.find(prompt[depth]);
    if (it == node->children.end()) break;
    const Node* child = it->second.get();
    const auto* key = first_accepted(child->through, accept);
    if (key == nullptr) break;  // deeper nodes only hold fewer keys
    int64_t m = 0;
    const auto label = static_cast<int64_t>(child->label.size());
    while (m < label && depth + m < n && child->label[m] == prompt[depth + m]) ++m;
    best = {depth + m, *key};
    if (m < label) break;
    depth += m;
    node = child;
  }
  return best;
}

TokenRadixTree::Match TokenRadixTree::longest_stored_prefix(const int64_t* prompt, int64_t n,
                                                            const Accept& accept) const {
  Match best;
  const Node* node = root_.get();
  if (const auto* key = first_accepted(node->ends, accept)) best.key = *key;
  int64_t depth = 0;
  while (depth < n) {
    auto it = node->children.find(prompt[depth]);
    if (it == node->children.end()) break;
    const Node* child = it->second.get();
    const auto label = static_cast<int64_t>(child->label.size());
    if (depth + label > n ||
        !std::equal(child->label.begin(), child->label.end(), prompt + depth)) {
      break;
    }
    depth += label;
    node = child;
    if (const auto* key = first_accepted(node->ends, accept)) best = {depth, *key};
  }
  return best;
}

}  // namespace kvchat
