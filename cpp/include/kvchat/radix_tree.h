// A radix tree over token ids: which stored sequences share the longest prefix
// with a prompt. Every answer comes from comparing whole token runs, never
// hashes, so a match is a real common prefix.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace kvchat {

class TokenRadixTree {
 public:
  struct Match {
    int64_t length = 0;  // tokens in common with the prompt
    std::string key;     // empty when nothing matched
  };
  using Accept = std::function<bool(const std::string&)>;

  TokenRadixTree();
  ~TokenRadixTree();
  TokenRadixTree(TokenRadixTree&&) noexcept;
  TokenRadixTree& operator=(TokenRadixTree&&) noexcept;

  // Stores ids under key (keys are unique; an existing key is replaced).
  void insert(const std::string& key, std::vector<int64_t> ids);
  // Forgets key; no-op when it is not stored.
  void erase(const std::string& key);
  bool contains(const std::string& key) const;
  size_t size() const { return sequences_.size(); }

  // The stored sequence sharing the longest prefix with prompt[0:n), among
  // keys `accept` allows (all when empty). Ties go to the smallest key.
  Match longest_common_prefix(const int64_t* prompt, int64_t n, const Accept& accept = {}) const;
  // The longest stored sequence that is a whole prefix of prompt[0:n).
  Match longest_stored_prefix(const int64_t* prompt, int64_t n, const Accept& accept = {}) const;

 private:
  struct Node;
  std::unique_ptr<Node> root_;
  std::map<std::string, std::vector<int64_t>> sequences_;  // key -> its ids, for erase
};

}  // namespace kvchat
